"""benchmarks/bench_decode_kernels.py runs end to end on CPU (Triton interpreter, tiny shapes): the decode steps it
would time are clean (it fails on a violation, on a slot left unverified, or on a TAIL FULL_HASH that differs
from the reference), with HiCache's settings and without."""

from __future__ import annotations

import json

import pytest

from script_loader import kernel_bench, on_cpu_kernels  # test/unit: on the path under pytest

bench_decode_kernels = kernel_bench("bench_decode_kernels")
ON_CPU_KERNELS = on_cpu_kernels("decode-kernels")


@ON_CPU_KERNELS
@pytest.mark.parametrize("extra", [[], ["--no-hicache"]])
def test_the_smoke_run_steps_clean_and_writes_its_report(tmp_path, extra):
    out = tmp_path / "decode.json"
    assert bench_decode_kernels.main(["--smoke", "--label", "t", "--out", str(out), *extra]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["hicache"] is (not extra)
    assert [(r["bs"], r["ctx"]) for r in report["results"]] == [(2, 8), (1, 5)]
    assert all(r["step_wall_ms"] > 0 for r in report["results"])


@ON_CPU_KERNELS
@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_a_shared_prefix_is_one_copy_read_by_every_request_and_steps_clean(tmp_path, real_data):
    """--shared-prefix: the smoke cases' requests read one copy of their first 4 (ctx 8) / 4 (ctx 5) positions; the
    run fails on any violation, so the shared slots' records (written once, by request 0) verify for every reader."""
    out = tmp_path / "decode.json"
    assert bench_decode_kernels.main(["--smoke", "--no-hicache", "--real-data", real_data, "--shared-prefix", "4",
                                      "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["shared_prefix"] == 4
    import torch

    args = bench_decode_kernels.parse_args(["--no-hicache", "--real-data", real_data, "--shared-prefix", "4"])
    rig = bench_decode_kernels.DecodeRig(torch, torch.device("cpu"), 3, 8, args, 2, 2, 16, 256)
    rows = rig.head_mgr._req_to_token[1:4]
    assert torch.equal(rows[1, :4], rows[0, :4]) and torch.equal(rows[2, :4], rows[0, :4])
    assert len(set(rows[:, 4:8].reshape(-1).tolist())) == 12  # the rest is each request's own
    before = int(rig.counters[rig.fp.C_SLOTS_VERIFIED])
    rig.step()
    assert rig.check(before) == 3 * 8  # every reader's lanes verified, shared ones included


def test_a_bad_case_is_refused_naming_the_flag():
    with pytest.raises(SystemExit):
        bench_decode_kernels.parse_args(["--cases", "48by2048"])
    with pytest.raises(SystemExit):  # a shared prefix must leave each request a position of its own
        bench_decode_kernels.parse_args(["--cases", "4x16", "--shared-prefix", "16"])


@ON_CPU_KERNELS
def test_the_rig_check_fails_on_a_wrong_tail_hash_and_on_a_violation():
    import torch

    from kv_canary import fingerprint as fp

    args = bench_decode_kernels.parse_args(["--label", "t"])
    rig = bench_decode_kernels.DecodeRig(torch, torch.device("cpu"), 2, 8, args, 2, 2, 16, 256)
    rig.step()
    rig.check(0)
    slot = int(rig.view.out_cache_loc[0])
    rig.group.records[slot, fp.F_FULL_HASH] ^= 1
    with pytest.raises(SystemExit, match="FULL_HASH"):
        rig.check(0)
    rig.group.records[slot, fp.F_FULL_HASH] ^= 1
    rig.counters[fp.C_VIOLATIONS] = 1
    with pytest.raises(SystemExit, match="violation"):
        rig.check(0)


@ON_CPU_KERNELS
def test_a_launch_shape_override_runs_clean_is_reported_and_restored(tmp_path):
    """--full-row-shape: the whole-row hash's launch shape replaced for the run (a first-read grid of one slot block,
    one row a program for every mode); the steps stay clean, the report names the shape used, and the module's shape
    is restored after the run."""
    from kv_canary.kernels import full_row

    before = full_row.SHAPE
    out = tmp_path / "decode.json"
    assert bench_decode_kernels.main(["--smoke", "--no-hicache", "--real-data", "all", "--out", str(out),
                                      "--full-row-shape", "persistent_programs=0,2,1",
                                      "--full-row-shape", "rows_per_program=1,1,1"]) == 0
    shape = json.loads(out.read_text())["config"]["full_row_shape"]
    assert shape["persistent_programs"] == [0, 2, 1] and shape["rows_per_program"] == [1, 1, 1]
    assert shape["tile_elements"] == before.tile_elements and full_row.SHAPE is before


@pytest.mark.parametrize("value", ["target_programs", "target_programs=x", "rows_per_program=1,-1,1"])
def test_a_malformed_shape_override_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        bench_decode_kernels.parse_args(["--full-row-shape", value])
    assert "--full-row-shape" in capsys.readouterr().err


def test_an_unknown_shape_field_or_arity_is_refused_naming_the_flag():
    from kv_canary.kernels import full_row

    for fields in ({"no_such_field": 3}, {"target_programs": (1, 2, 3)}, {"rows_per_program": 4}):
        with pytest.raises(SystemExit, match="--full-row-shape"):
            bench_decode_kernels.shape_override(full_row.SHAPE, fields)
    assert bench_decode_kernels.shape_override(full_row.SHAPE, {"warps": 8}).warps == 8
