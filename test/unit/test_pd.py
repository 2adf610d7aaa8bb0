"""PD disaggregation pieces on real sglang objects (CPU): the buffer list, the transfer's own
address arithmetic, the mismatch guard, the arrival book, retraction, and the startup gate."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from kv_canary import fingerprint as fp
from kv_canary.adapter import disagg
from kv_canary.adapter.pools import register_sglang_pools
from kv_canary.buffer_groups import attach_canary_buffers
from kv_canary.config import CanaryConfig, CanaryMode
from kv_canary.violations import parse_lines
from kv_canary.transfer import Arrival, TransferBook, extra_buf_infos, mark_sent, new_origin, splice

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")


def _pool(size=64, layers=3):
    register_sglang_pools()
    pool = memory_pool.MHATokenToKVPool(
        size=size, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=layers,
        device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )
    groups = attach_canary_buffers(pool, CanaryConfig(mode=CanaryMode.LOG), torch.device("cpu"))
    return pool, groups[0], new_origin(groups[0].num_slots, torch.device("cpu"))


def _mooncake_manager(kv_infos):
    """sglang's MooncakeKVManager with its real send path; only the wire (_transfer_data) is a local memmove."""
    conn = pytest.importorskip("sglang.srt.disaggregation.mooncake.conn")
    mgr = object.__new__(conn.MooncakeKVManager)
    mgr.is_mla_backend = False
    mgr.enable_custom_mem_pool = False
    mgr.kv_args = SimpleNamespace(kv_data_ptrs=kv_infos[0], kv_data_lens=kv_infos[1], kv_item_lens=kv_infos[2],
                                  prefill_start_layer=0)

    def transfer(_session, blocks):
        for src, dst, length in blocks:
            ctypes.memmove(dst, src, length)
        return 0

    mgr._transfer_data = transfer
    return conn, mgr


def test_records_and_origin_travel_with_the_kv_through_sglangs_send_path():
    p_pool, p_group, p_origin = _pool()
    d_pool, d_group, d_origin = _pool()
    p_infos = splice(p_pool.get_contiguous_buf_infos(), extra_buf_infos(p_group.records, p_origin, 1))
    d_infos = splice(d_pool.get_contiguous_buf_infos(), extra_buf_infos(d_group.records, d_origin, 1))
    assert len(p_infos[0]) == 2 * 3 + 2 and p_infos[2][-2:] == [8 * fp.RECORD_WIDTH, 16]
    src, dst = [5, 6, 7, 20], [40, 41, 9, 10]
    for layer in range(3):
        p_pool.k_buffer[layer].normal_()
        p_pool.v_buffer[layer].normal_()
    p_group.records[src] = torch.arange(len(src) * fp.RECORD_WIDTH, dtype=torch.int64).reshape(len(src), -1) + 100
    mark_sent(p_origin, src, 1, room=987654321)
    conn, mgr = _mooncake_manager(p_infos)
    import numpy as np

    rc = disagg.around_send_kvcache(conn.MooncakeKVManager.send_kvcache, mgr, "session",
                                    np.array(src, dtype=np.int32), d_infos[0], np.array(dst, dtype=np.int32), None)
    assert rc == 0
    for layer in range(3):
        assert torch.equal(d_pool.k_buffer[layer][dst], p_pool.k_buffer[layer][src])
        assert torch.equal(d_pool.v_buffer[layer][dst], p_pool.v_buffer[layer][src])
    assert torch.equal(d_group.records[dst], p_group.records[src])
    assert d_origin[dst].tolist() == [[987654321, s] for s in src]
    assert d_group.records[[1, 2, 3]].abs().sum() == 0  # nothing else moved


def test_a_peer_without_the_canary_buffers_is_refused_not_mispaired(caplog):
    p_pool, p_group, p_origin = _pool()
    d_pool, _, _ = _pool()
    p_infos = splice(p_pool.get_contiguous_buf_infos(), extra_buf_infos(p_group.records, p_origin, 1))
    conn, mgr = _mooncake_manager(p_infos)
    import numpy as np

    before = [b.clone() for b in d_pool.v_buffer]
    with caplog.at_level("ERROR", logger="kv_canary"):
        rc = disagg.around_send_kvcache(conn.MooncakeKVManager.send_kvcache, mgr, "peer-without-canary",
                                        np.array([1], dtype=np.int32), d_pool.get_contiguous_buf_infos()[0],
                                        np.array([2], dtype=np.int32), None)
    assert rc == -1
    assert all(torch.equal(a, b) for a, b in zip(before, d_pool.v_buffer))
    assert "kv_canary_pd_mismatch=1" in caplog.text and "--kv-canary on/off" in caplog.text


def test_book_counts_arrivals_verified_by_their_first_forward_and_names_the_origin():
    origin = new_origin(16, torch.device("cpu"))
    mark_sent(origin, [3, 4, 5], 1, room=77)
    book = TransferBook("decode", origin)
    book.note_arrival(Arrival(rid="r1", room=77, row=2, received=3))
    book.note_arrival(Arrival(rid="r2", room=78, row=3, received=5))
    book.forward_ran(["r1", "other"])
    book.forward_ran(["r1"])  # a second read is not a first verification
    assert (book.requests_received, book.slots_received, book.slots_verified) == (2, 8, 3)
    assert book.identity("r1", slot=4, position=1) == {"bootstrap_room": 77, "origin_room": 77, "origin_slot": 4}
    assert book.identity("r1", slot=9, position=2) == {"bootstrap_room": 77, "origin": "missing"}
    assert book.identity("r1", slot=4, position=3) == {"bootstrap_room": 77}  # decode-written position
    assert book.stats() == {"pd_requests_received": 2, "pd_slots_received": 8, "pd_slots_verified": 3,
                            "pd_fake_requests": 0}


def _decode_harness(mode=CanaryMode.LOG, init_finished=True, **config_fields):
    """The runner harness (real ForwardBatch objects, reference kernels) as a PD decode side."""
    from kv_canary_testing.runner_harness import Harness

    h = Harness(mode=mode, **config_fields)
    group = h.manager.groups[0]
    h.manager.attach_transfer(TransferBook("decode", new_origin(group.num_slots, torch.device("cpu"))))
    if init_finished:
        h.manager.mark_init_finished()
    return h, group


def _prefill_and_transfer(h, group, row, tokens, room):
    """What the prefill + transfer leave on the decode side: KV rows and the prefill's records in new slots."""
    prefill, p_group = _decode_harness()
    prefill.step(prefill.batch({1: tokens}))
    src = prefill.r2t[1, : len(tokens)].long()
    dst = torch.arange(200, 200 + len(tokens))
    h.k[dst], h.v[dst] = prefill.k[src], prefill.v[src]
    group.records[dst] = p_group.records[src]
    h.manager.transfer.origin[dst] = torch.stack([torch.full_like(src, room), src], 1)
    h.r2t[row, : len(tokens)] = dst.to(torch.int32)
    h.lens[row] = len(tokens)
    return dst


def test_decode_side_verifies_the_transfer_and_continues_the_chain(caplog):
    h, group = _decode_harness()
    tokens = [5, 6, 7, 8]
    dst = _prefill_and_transfer(h, group, row=2, tokens=tokens, room=4242)
    h.manager.note_transfer_arrival(Arrival(rid="r2", room=4242, row=2, received=4), tokens, [9])
    with caplog.at_level("ERROR", logger="kv_canary"):
        h.step(h.batch({2: [9]}, decode=True))  # HEAD reads the 4 received slots, TAIL chains position 4 on
        h.step(h.batch({2: [10]}, decode=True))
        h.manager.poll(drain=True)
    assert h.manager.violations_reported == 0, caplog.text
    assert h.manager.transfer.stats()["pd_slots_verified"] == 4
    h.v[dst[1]] += 1.0  # the transferred bytes of position 1 change after arrival
    with caplog.at_level("ERROR", logger="kv_canary"):
        h.step(h.batch({2: [11]}, decode=True))
        h.manager.poll(drain=True)
    (v,) = parse_lines(caplog.text, "kv_canary_violation")
    assert (v["kind"], v["rid"], v["position"]) == ("kv_hash", "r2", "1")
    assert (v["bootstrap_room"], v["origin_room"]) == ("4242", "4242") and int(v["origin_slot"]) > 0


def test_a_prefill_flip_and_a_transfer_flip_of_the_same_byte_do_not_cancel(caplog):
    """The CI miss of issue 10: both PD servers ran SGLANG_KV_CANARY_PERTURB_SEED=5, so their RNG streams were
    mirrors; a prefill forward of one request (real_kv_post_forward) and that request's arrival on the decode
    (transfer) drew the same position, half and byte, and two XORs with 0xFF left the KV unchanged. The transfer
    mode flips with its own mask: the byte stays changed, and the decode side reports it."""
    from kv_canary.perturb.real_kv import FLIP_MASK, TRANSFER_FLIP_MASK

    assert TRANSFER_FLIP_MASK not in (0, FLIP_MASK)
    same = dict(mode=CanaryMode.LOG, perturb_seed=5, perturb_warmup_steps=0, perturb_kv_bytes="hashed")
    prefill, p_group = _decode_harness(perturb_real_kv_post_forward_prob=1.0, **same)
    h, group = _decode_harness(perturb_transfer_prob=1.0, **same)
    tokens = [5, 6, 7, 8, 9, 10]
    with caplog.at_level("WARNING", logger="kv_canary"):
        prefill.step(prefill.batch({1: tokens}))  # TAIL fingerprints, then the post-forward flip
    src = prefill.r2t[1, : len(tokens)].long()
    dst = torch.arange(200, 200 + len(tokens))
    h.k[dst], h.v[dst] = prefill.k[src], prefill.v[src]  # the transfer: bytes and records as they are
    group.records[dst] = p_group.records[src]
    h.manager.transfer.origin[dst] = torch.stack([torch.full_like(src, 7), src], 1)
    h.r2t[2, : len(tokens)] = dst.to(torch.int32)
    h.lens[2] = len(tokens)
    h.manager.note_transfer_arrival(Arrival(rid="r2", room=7, row=2, received=len(tokens)), tokens, [11])
    with caplog.at_level("WARNING", logger="kv_canary"):
        h.step(h.batch({2: [11]}, decode=True))  # the transfer flip, then HEAD reads every received slot
        h.manager.poll(drain=True)
    pre, xfer = parse_lines(caplog.text, "kv_canary_perturb")
    assert (pre["kv_canary_perturb"], xfer["kv_canary_perturb"]) == ("real_kv_post_forward", "transfer")
    # the mirrored streams picked the same position, half and byte on both sides
    assert src.tolist().index(int(pre["slot"])) == int(xfer["position"])
    assert (pre["half"], pre["layer"], pre["byte"]) == (xfer["half"], xfer["layer"], xfer["byte"])
    (v,) = parse_lines(caplog.text, "kv_canary_violation")
    assert (v["kind"], v["rid"], v["position"], v["slot"]) == ("kv_hash", "r2", xfer["position"], xfer["slot"])
    assert v["origin_slot"] == pre["slot"]  # one violation explains both injections


def test_a_fake_transfer_is_fingerprinted_in_place_without_touching_the_counters(caplog):
    h, group = _decode_harness()
    h.r2t[3, :4] = torch.tensor([150, 151, 152, 153], dtype=torch.int32)  # slots sglang filled with nothing
    h.k[150:154] = 3.25
    h.lens[3] = 4
    before = h.manager.counters.clone()
    h.manager.note_fake_arrival(3, "HEALTH_CHECK_1", [0, 1, 2, 3], [4])
    assert torch.equal(h.manager.counters, before)
    with caplog.at_level("ERROR", logger="kv_canary"):
        h.step(h.batch({3: [4]}, decode=True))
        h.manager.poll(drain=True)
    assert h.manager.violations_reported == 0 and h.manager.health_violations == 0, caplog.text
    assert h.manager.transfer.fake_requests == 1


def test_precompile_covers_the_fake_transfer_writes_of_any_length(caplog):
    """sglang's PD warm-up and health checks arrive as fake transfers after startup; their TAIL write (no forward
    bump, no fed-token check) is precompiled for every block, so none compiles while serving (the H100 PD run of
    2026-11-25 logged kv_canary_jit_after_startup for it before)."""
    from kv_canary.kernels.triton_kernels import tail_variant
    from kv_canary.kernels.variants import VariantTracker, track, write_block_lengths

    h, group = _decode_harness(init_finished=False)
    m, tracker = h.manager, VariantTracker()
    m.kernels = track(m.kernels, tracker, tail_variant)
    for sfm in m.single_forward_managers:
        sfm._kernels = m.kernels
    m.variant_tracker = tracker
    ctx = int(h.r2t.shape[1])
    m.precompile(sorted(write_block_lengths(tail_variant, ctx).values()), [1])
    assert any(k[0] == "write" and k[5:7] == (False, False) for k in tracker.seen)  # no bump, no fed check
    assert int(m.counters[fp.C_SLOTS_WRITTEN]) == 0  # inert
    tracker.seal()
    m.mark_init_finished()
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        for row, n in ((3, 4), (4, 1), (5, ctx - 1)):
            h.r2t[row, :n] = torch.arange(100, 100 + n, dtype=torch.int32)
            m.note_fake_arrival(row, f"HEALTH_CHECK_{row}", list(range(n)), [7])
    assert tracker.after_startup == {} and "kv_canary_jit_after_startup" not in caplog.text
    assert m.transfer.fake_requests == 3


def test_decode_retraction_carries_the_records_to_the_host_and_back(monkeypatch):
    """sglang's own Req.offload_kv_cache / load_kv_cache with the plugin's hooks around them."""
    # sglang's MHATokenToKVPool.get_cpu_copy/load_cpu_copy call torch.cuda.synchronize() unconditionally
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool, group, _ = _pool(size=64)
    allocator = TokenToKVPoolAllocator(size=64, dtype=torch.float32, device="cpu", kvcache=pool,
                                       need_sort=False)
    req_to_token = memory_pool.ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    req = Req("r", "", [11, 12, 13, 14], SamplingParams(max_new_tokens=4))
    req.output_ids = [15, 16]
    req.req_pool_idx = 1
    old = allocator.alloc(5)
    req_to_token.req_to_token[1, :5] = old.to(torch.int32)
    group.records[old] = torch.arange(5 * fp.RECORD_WIDTH, dtype=torch.int64).reshape(5, -1) + 1
    pool.k_buffer[0][old] = 1.5
    req.offload_kv_cache(req_to_token, allocator)
    disagg.after_offload_kv_cache(None, req, req_to_token, allocator)
    saved = group.records[old].clone()
    allocator.free(old)
    group.records[old] = 0
    new = allocator.alloc(5).flip(0)  # other slots
    req_to_token.req_to_token[1, :5] = new.to(torch.int32)
    disagg.around_load_kv_cache(Req.load_kv_cache, req, req_to_token, allocator)
    assert torch.equal(group.records[new], saved) and bool((pool.k_buffer[0][new] == 1.5).all())
    assert not hasattr(req, "kv_canary_records_cpu")


def _gate_results(cases):
    """Run sglang's own argument parsing (with the plugin loaded) for each (args, env) case in one process."""
    from kv_canary_testing.model_dir import write_model_dir

    code = textwrap.dedent(f"""
        import os
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        for args, env in {cases!r}:
            saved = dict(os.environ)
            os.environ.update(env)
            try:
                prepare_server_args(["--model-path", {str(write_model_dir())!r}, "--device", "cpu", *args])
                print("RESULT OK")
            except BaseException as e:
                print("RESULT ERR", type(e).__name__, str(e).replace(chr(10), " "))
            os.environ.clear()
            os.environ.update(saved)
    """)
    from kv_canary_testing.server import SglangServer

    env = SglangServer(device="cpu").environment()  # the libcuda stand-in: sglang's scheduler module imports
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == len(cases), r.stdout[-2000:] + r.stderr[-3000:]
    return lines


PD = ["--disaggregation-mode", "decode"]
GATE_CASES = [
    (["--kv-canary", "raise", *PD], {}, "OK"),
    (["--kv-canary", "log", "--disaggregation-mode", "prefill"], {}, "OK"),
    (["--kv-canary", "none", *PD, "--disaggregation-transfer-backend", "nixl"], {}, "OK"),
    (["--kv-canary", "log", *PD, "--disaggregation-transfer-backend", "nixl"], {},
     "--disaggregation-transfer-backend mooncake only, not nixl"),
    (["--kv-canary", "log", *PD, "--disaggregation-transfer-backend", "fake"], {},
     "--disaggregation-transfer-backend mooncake only, not fake"),
    (["--kv-canary", "log", *PD, "--disaggregation-decode-enable-radix-cache"], {},
     "does not verify --disaggregation-decode-enable-radix-cache"),
    (["--kv-canary", "log", *PD, "--page-size", "16"], {}, "--page-size 1 only on sglang 0.5.12, not 16"),
    (["--kv-canary", "log", *PD], {"SGLANG_DISAGG_STAGING_BUFFER": "1"}, "SGLANG_DISAGG_STAGING_BUFFER=1"),
    (["--kv-canary", "log"], {"SGLANG_KV_CANARY_PERTURB_TRANSFER_PROB": "0.5"},
     "SGLANG_KV_CANARY_PERTURB_TRANSFER_PROB corrupts KV received by PD transfer"),
    (["--kv-canary", "log", "--disaggregation-mode", "prefill"], {"SGLANG_KV_CANARY_PERTURB_TRANSFER_PROB": "0.5"},
     "needs --disaggregation-mode decode, not prefill"),
    (["--kv-canary", "log", *PD, "--kv-canary-real-data", "all"], {}, "--kv-canary-real-data partial only, not all"),
    (["--kv-canary", "log", *PD], {"SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD": "64"},
     "default SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD only"),
]


def test_startup_gate_accepts_what_is_verified_and_refuses_the_rest_naming_the_flag():
    results = _gate_results([(args, env) for args, env, _ in GATE_CASES])
    for (args, env, want), got in zip(GATE_CASES, results):
        if want == "OK":
            assert got == "RESULT OK", (args, env, got)
        else:
            assert got.startswith("RESULT ERR CanaryConfigError") and want in got, (args, env, got)
