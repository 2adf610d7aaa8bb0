"""Fast checks of kv_canary_testing helpers that need no server."""

import ctypes
import json
import os

import pytest

from kv_canary_testing.libcuda_stub import STUB_SYMBOLS, ensure_libcuda_stub
from kv_canary_testing.model_dir import ARCHITECTURE, write_model_dir
from kv_canary_testing.server import SglangServer, free_port
from kv_canary_testing.workload import DISCONNECT_ABORT_LOST, abort_mode_for, build_workload


def test_model_dir_is_idempotent_and_tokenizes_words(tmp_path):
    path = write_model_dir(tmp_path / "m")
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert write_model_dir(tmp_path / "m") == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.encode("w0 w1 w507").ids == [4, 5, 511]
    assert tok.get_vocab_size() == config["vocab_size"]


def test_libcuda_stub_exports_symbols(tmp_path):
    lib_dir = ensure_libcuda_stub(tmp_path)
    assert ensure_libcuda_stub(tmp_path) == lib_dir
    lib = ctypes.CDLL(str(lib_dir / "libcuda.so.1"))
    for name in STUB_SYMBOLS:
        assert getattr(lib, name) is not None
    msg = ctypes.c_char_p()
    assert lib.cuGetErrorString(0, ctypes.byref(msg)) == 999


def test_server_command_overrides_and_devices(tmp_path):
    pytest.importorskip("sglang")  # the command follows the installed sglang line
    port = free_port()
    assert 20000 <= port < 32000
    srv = SglangServer(["--max-total-tokens", "999", "--kv-canary", "raise"],
                       model_path=tmp_path, port=port, log_path=tmp_path / "log")
    cmd = srv.command()
    assert cmd.count("--max-total-tokens") == 1 and "999" in cmd
    assert cmd[cmd.index("--port") + 1] == str(port)
    assert "torch_native" in cmd
    # a default flag the installed sglang line lacks is left out (0.5.23: no piecewise flag; its warmup runs)
    from kv_canary_testing.server import NOT_ON_LINE, installed_sglang_version

    dropped = NOT_ON_LINE.get(installed_sglang_version(), ())
    assert ("--disable-piecewise-cuda-graph" in cmd) is ("--disable-piecewise-cuda-graph" not in dropped)
    assert ("--skip-server-warmup" in cmd) is ("--skip-server-warmup" not in dropped)
    env = srv.environment()
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "kv_canary_testing.tiny_model"
    assert "libcuda-stub-" in env["LD_LIBRARY_PATH"]

    gpu = SglangServer(model_path=tmp_path, device="cuda", log_path=tmp_path / "log",
                       drop_default_args=["--load-format"])
    gcmd = gpu.command()
    assert "triton" in gcmd and "--disable-cuda-graph" not in gcmd
    assert "--load-format" not in gcmd
    # the entry: on CPU sglang's children forked from one pre-imported process, unless asked for sglang's own spawn
    # (KVC_TEST_SPAWN=1 or spawn_children=True); on the GPU host always sglang's own entry
    assert gcmd[gcmd.index("-m") + 1] == "sglang.launch_server"
    spawned = SglangServer(model_path=tmp_path, log_path=tmp_path / "log", spawn_children=True).command()
    assert spawned[spawned.index("-m") + 1] == "sglang.launch_server"
    if os.environ.get("KVC_TEST_SPAWN", "0") != "1":
        assert cmd[cmd.index("-m") + 1] == "kv_canary_testing.fast_launch"


def test_workload_plan_is_deterministic():
    a = build_workload(50, seed=3)
    assert a == build_workload(50, seed=3)
    assert a != build_workload(50, seed=4)
    assert {s.kind for s in a} == {"shared", "long", "short", "abort"}


def test_releases_that_lose_a_disconnects_abort_abort_through_the_api_only():
    assert DISCONNECT_ABORT_LOST == ("0.5.18", "0.5.19")
    assert {abort_mode_for(r) for r in DISCONNECT_ABORT_LOST} == {"api"}
    assert {abort_mode_for(r) for r in ("0.5.12", "0.5.17", "0.5.20", "0.5.21", "0.5.23", None)} == {"mixed"}


def test_servers_share_a_launcher_zygote_only_where_their_environment_differs_in_the_canarys_variables_alone():
    from kv_canary_testing.launcher_zygote import zygote_key

    base = {"PYTHONPATH": "/a", "LD_LIBRARY_PATH": "/stub"}
    same = zygote_key("py", {**base, "SGLANG_KV_CANARY_PERTURB_SEED": "5"})
    assert same == zygote_key("py", base) == zygote_key("py", {**base, "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "1"})
    # what sglang or the tiny model may read while being imported keeps them apart, as does the interpreter
    assert zygote_key("py", {**base, "KVC_TINY_FAIL_AT_EXTEND": "12"}) != same
    assert zygote_key("py", {**base, "PYTHONPATH": "/real-bugs/x:/a"}) != same
    assert zygote_key("other-py", base) != same
