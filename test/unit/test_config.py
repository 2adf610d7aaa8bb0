"""CanaryConfig: flags + SGLANG_KV_CANARY_* env vars, and their errors."""

from __future__ import annotations

import pytest

from kv_canary.config import ALL_SCRUB_SLOTS_PER_FORWARD, ENV_VARS, CanaryConfig, CanaryConfigError, CanaryMode, KernelBackend


def build(mode="raise", env=None, **kw):
    return CanaryConfig.build(mode=mode, environ=env or {}, **kw)


def test_defaults_and_modes():
    assert build("none").mode is CanaryMode.NONE and not build("none").enabled
    c = build("LOG")
    assert c.mode is CanaryMode.LOG and c.enabled
    assert (c.kv_hash_bytes, c.kv_hash_layers, c.d2h_delay_steps) == (16, (0,), 2)
    assert c.perturb_warmup_steps == 50 and c.perturb_real_kv_used_prob == 0.0


def test_bad_mode_names_the_flag():
    with pytest.raises(CanaryConfigError, match="--kv-canary 'loud'"):
        build("loud")


def test_env_values_are_parsed():
    c = build(env={
        "SGLANG_KV_CANARY_KV_HASH_BYTES": "32",
        "SGLANG_KV_CANARY_KV_HASH_LAYERS": "0, 3",
        "SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.25",
        "SGLANG_KV_CANARY_KERNEL_BACKEND": "torch",
        "OTHER_VAR": "ignored: not ours",
    })
    assert c.kv_hash_bytes == 32 and c.kv_hash_layers == (0, 3)
    assert c.perturb_real_kv_used_prob == 0.25 and c.kernel_backend is KernelBackend.TORCH
    assert ("SGLANG_KV_CANARY_KV_HASH_BYTES", "32") in c.env_overrides


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("SGLANG_KV_CANARY_KV_HASH_BYTES", "18", "multiple of 4"),
        ("SGLANG_KV_CANARY_KV_HASH_BYTES", "lots", "expected an integer"),
        ("SGLANG_KV_CANARY_KV_HASH_LAYERS", "0,0", "repeat"),
        ("SGLANG_KV_CANARY_KV_HASH_LAYERS", "", "layer ids"),
        ("SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB", "1.5", r"probability in \[0, 1\]"),
        ("SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS", "-1", ">= 0"),
        ("SGLANG_KV_CANARY_KERNEL_BACKEND", "cuda", "auto, triton, torch"),
        ("SGLANG_KV_CANARY_D2H_DELAY_STEPS", "100", r"in \[0, 64\]"),
    ],
)
def test_malformed_env_values_name_the_variable(name, value, match):
    with pytest.raises(CanaryConfigError, match=match) as info:
        build(env={name: value})
    assert name in str(info.value)


def test_unknown_env_var_is_an_error_listing_known_ones():
    with pytest.raises(CanaryConfigError, match="unknown env var SGLANG_KV_CANARY_PERTURB_REAL_KV_USD_PROB") as info:
        build(env={"SGLANG_KV_CANARY_PERTURB_REAL_KV_USD_PROB": "0.1"})
    for suffix in ENV_VARS:
        assert "SGLANG_KV_CANARY_" + suffix in str(info.value)


def test_piecewise_cuda_graph_needs_to_be_disabled():
    with pytest.raises(CanaryConfigError, match="pass --disable-piecewise-cuda-graph"):
        build("raise", disable_piecewise_cuda_graph=False)
    assert build("none", disable_piecewise_cuda_graph=False).mode is CanaryMode.NONE
    assert isinstance(CanaryConfigError("x"), ValueError)


def test_perturbation_without_canary_is_an_error():
    with pytest.raises(CanaryConfigError, match="canary is off"):
        build("none", env={"SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.5"})


def test_sweep_interval_needs_canary():
    with pytest.raises(CanaryConfigError, match="--kv-canary-sweep-interval 5 needs the canary on"):
        build("none", sweep_interval=5)


def test_config_is_frozen():
    c = build()
    with pytest.raises(Exception):
        c.mode = CanaryMode.NONE  # type: ignore[misc]


def test_real_data_flag_and_its_conflicts():
    from kv_canary.config import RealData

    assert build().real_data is RealData.PARTIAL and build(real_data="ALL").real_data is RealData.ALL
    with pytest.raises(CanaryConfigError, match="--kv-canary-real-data 'most'"):
        build(real_data="most")
    with pytest.raises(CanaryConfigError, match="SGLANG_KV_CANARY_KV_HASH_BYTES tunes the hashed window"):
        build(real_data="none", env={"SGLANG_KV_CANARY_KV_HASH_BYTES": "32"})
    assert build(real_data="all", env={"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "64"}).scrub_slots_per_forward == 64
    assert build(real_data="all", env={}).scrub_slots_per_forward == ALL_SCRUB_SLOTS_PER_FORWARD  # all's default
    assert build(real_data="all", env={}).full_row_hash and not build(env={}).full_row_hash
    assert build(env={"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "64"}).scrub_slots_per_forward == 64


def test_the_scrub_states_its_bound():
    """``scrub_bound_forwards``: the forwards within which the scrub checks every slot of the pool once (logged at
    startup as ``every_slot_within_forwards=``); 0 with the scrub off; a window wider than the pool is the pool."""
    assert build(real_data="all", env={}).scrub_bound_forwards(131072) == 131072 // ALL_SCRUB_SLOTS_PER_FORWARD
    assert build(env={}).scrub_bound_forwards(131072) == 0
    assert build(env={"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "100"}).scrub_bound_forwards(1000) == 10
    assert build(env={"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "4096"}).scrub_bound_forwards(1000) == 1


@pytest.mark.parametrize("value,ok", [("anywhere", True), ("hashed", True), ("-1:k:mid", True), ("0:v:12", True),
                                      ("last:k:mid", False), ("0:q:1", False), ("somewhere", False)])
def test_perturb_kv_bytes_spec(value, ok):
    env = {"SGLANG_KV_CANARY_PERTURB_KV_BYTES": value}
    if ok:
        assert build(env=env).perturb_kv_bytes == value
    else:
        with pytest.raises(CanaryConfigError, match="SGLANG_KV_CANARY_PERTURB_KV_BYTES"):
            build(env=env)


def test_token_oracle_switches():
    assert build().uses_token_oracle
    c = build(env={"SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "0", "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT": "0"})
    assert not c.uses_token_oracle  # nothing would read it: not kept
    assert not build(env={"SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE": "0"}).uses_token_oracle


def test_perturb_dp_rank_keeps_the_perturbations_on_that_data_parallel_rank_only():
    c = build(env={"SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.2", "SGLANG_KV_CANARY_PERTURB_DP_RANK": "1"})
    assert c.perturb_dp_rank == 1 and "perturb_dp_rank=1" in c.describe()
    assert c.for_tp_rank(0, 1).perturb_real_kv_used_prob == 0.2
    assert c.for_tp_rank(0, 0).perturb_real_kv_used_prob == 0.0  # another DP rank: no injection
    assert c.for_tp_rank(0, None).perturb_real_kv_used_prob == 0.0  # no --dp-size: the one rank is rank 0
    both = build(env={"SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.2", "SGLANG_KV_CANARY_PERTURB_DP_RANK": "1",
                      "SGLANG_KV_CANARY_PERTURB_TP_RANK": "0"})
    assert both.for_tp_rank(0, 1).perturb_real_kv_used_prob == 0.2
    assert both.for_tp_rank(1, 1).perturb_real_kv_used_prob == 0.0
    assert build(env={"SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB": "0.2"}).for_tp_rank(
        0, 1).perturb_real_kv_used_prob == 0.2  # unset: every rank perturbs
