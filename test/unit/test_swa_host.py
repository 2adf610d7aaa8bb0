"""Host side of the hybrid sliding-window support: the divergence line, the startup refusals, the
perturbation's group choice and slot translation (plain tensors, no server)."""

from __future__ import annotations

import random

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.api import check_groups_supported
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig, CanaryConfigError, CanaryMode
from kv_canary.perturb.manager import PerturbManager
from kv_canary.perturb.slot_picker import pick_read_slot
from kv_canary.swa_divergence import SwaDivergenceLog
from kv_canary.views import HostBatch

CPU = torch.device("cpu")


def _groups(window=4):
    kf = [torch.zeros(20, 2, 4) for _ in range(2)]
    ks = [torch.zeros(12, 2, 4)]
    mapping = torch.zeros(22, dtype=torch.int64)
    mapping[1:12] = torch.arange(11, 0, -1)  # full slot s -> swa slot 12 - s
    config = CanaryConfig()
    return [build_group(PoolLayout("full", kf, kf), config, CPU),
            build_group(PoolLayout("swa", ks, ks, slot_translation=mapping, window=window), config, CPU)]


def test_divergence_line_round_trips_and_comes_from_the_counters():
    c = [0] * fp.NUM_COUNTERS
    c[fp.C_FORWARD_INDEX], c[fp.C_SLOTS_VERIFIED], c[fp.C_SWA_VERIFIED] = 40, 1000, 120
    c[fp.C_SWA_DIVERGENCE], c[fp.C_SWA_OUT_OF_WINDOW] = 7, 300
    log = SwaDivergenceLog.from_counters(c)
    assert (log.verify_full, log.verify_swa, log.swa_full_idx_divergence, log.swa_out_of_window_tokens) == (
        880, 120, 7, 300)
    line = log.format()
    assert line == ("kv_canary_swa_divergence=40 verify_full=880 verify_swa=120 swa_full_idx_divergence=7 "
                    "swa_out_of_window_tokens=300")
    assert SwaDivergenceLog.parse("[2026] " + line + " settled=1") == log
    older = SwaDivergenceLog(10, 1, 1, 0, 0)
    assert SwaDivergenceLog.find_last(f"{older.format()}\nnoise\n{line}\n") == log
    assert SwaDivergenceLog.parse("kv_canary_stats=3 x=1") is None


def test_config_reads_the_interval():
    config = CanaryConfig.build(mode="log", environ={"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "25"})
    assert config.swa_divergence_stats_interval == 25
    with pytest.raises(CanaryConfigError, match="SWA_DIVERGENCE_STATS_INTERVAL"):
        CanaryConfig.build(mode="log", environ={"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "-1"})


def test_startup_refusals_with_several_groups():
    groups = _groups()
    check_groups_supported(CanaryConfig(mode=CanaryMode.LOG, swa_divergence_stats_interval=5), groups, "SWAKVPool",
                           None)  # fine
    with pytest.raises(CanaryConfigError, match="--kv-canary contain is not supported with the KV pool SWAKVPool"):
        check_groups_supported(CanaryConfig(mode=CanaryMode.CONTAIN), groups, "SWAKVPool", None)
    with pytest.raises(CanaryConfigError, match="--disaggregation-mode decode"):
        check_groups_supported(CanaryConfig(mode=CanaryMode.LOG), groups, "SWAKVPool", "decode")
    with pytest.raises(CanaryConfigError, match="SWA_DIVERGENCE_STATS_INTERVAL=5: the KV pool MHATokenToKVPool"):
        check_groups_supported(CanaryConfig(mode=CanaryMode.LOG, swa_divergence_stats_interval=5), groups[:1],
                               "MHATokenToKVPool", None)


def test_windowed_picker_and_translated_injections_in_both_groups():
    groups = _groups(window=4)
    r2t = torch.zeros(4, 32, dtype=torch.int32)
    r2t[1, :10] = torch.arange(1, 11, dtype=torch.int32)
    batch = HostBatch(rows=[1], seq_lens=[11], new_lens=[1], rids=["a"])
    rng = random.Random(0)
    picked = {pick_read_slot(batch, r2t, rng, window=4).position for _ in range(200)}
    assert picked == {6, 7, 8, 9}  # the last 4 read positions only
    config = CanaryConfig(mode=CanaryMode.LOG, perturb_real_kv_used_prob=1.0, perturb_target_group="*",
                          perturb_warmup_steps=0)
    pm = PerturbManager(config=config, groups=groups, req_to_token=r2t)
    for f in range(40):
        pm.perturb_pre_forward(forward_index=f, host_batch=lambda: batch, view=lambda: None)
    lines = [dict(kv.split("=", 1) for kv in line.split()) for line in pm.injections]
    assert {d["group"] for d in lines} == {"full", "swa"}
    for d in lines:
        if d["group"] == "swa":  # the swa slot is the mapping of the engine slot, inside the window
            assert int(d["slot"]) == 12 - int(d["engine_slot"]) and 6 <= int(d["position"]) <= 9
        else:
            assert "engine_slot" not in d and int(d["slot"]) == int(d["position"]) + 1
    with pytest.raises(CanaryConfigError, match="or '\\*'"):
        PerturbManager(config=CanaryConfig(perturb_target_group="nope"), groups=groups, req_to_token=r2t)
