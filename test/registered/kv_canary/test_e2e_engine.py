"""``sglang.Engine(kv_canary=...)``: the Python API takes the canary settings like the CLI does.

A child process (CPU env: libcuda stand-in, tiny external model, TRITON_INTERPRET=1)
first builds an Engine with a setting the canary cannot verify -- refused with the
CanaryConfigError before any process starts -- then an Engine with
``kv_canary="raise", kv_canary_sweep_interval=2`` that serves a few requests with a
shared prefix; the scheduler's canary lines show it verified and swept slots.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kv_canary.violations import READY_PREFIX, STATS_PREFIX, VIOLATION_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import register_cpu_ci
from kv_canary_testing.model_dir import write_model_dir
from kv_canary_testing.server import SglangServer

register_cpu_ci(est_time=150, suite="kv-canary-cpu")

SCRIPT = textwrap.dedent("""
    import time, sys
    import sglang
    from kv_canary.config import CanaryConfigError

    COMMON = dict(model_path=sys.argv[1], device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                  sampling_backend="pytorch", load_format="dummy", dtype="float32", max_total_tokens=2048,
                  chunked_prefill_size=128, log_level="info")
    if sglang.__version__ == "0.5.12":  # a later line has no such flag (and no piecewise graphs on CPU)
        COMMON["disable_piecewise_cuda_graph"] = True

    if __name__ == "__main__":
        try:
            sglang.Engine(**COMMON, kv_canary="log", enable_torch_compile=True)
        except CanaryConfigError as e:
            print("ENGINE_REFUSED", e, flush=True)
        engine = sglang.Engine(**COMMON, kv_canary="raise", kv_canary_sweep_interval=2)
        shared = " ".join(f"w{i}" for i in range(40))
        prompts = [shared + f" w{100 + i} w{200 + i}" for i in range(4)] + ["w7 w8 w9"]
        outs = engine.generate(prompts, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        again = engine.generate(prompts[0], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        print("ENGINE_OUTPUTS", len(outs), sum(o["meta_info"]["completion_tokens"] for o in outs),
              again["meta_info"]["cached_tokens"], flush=True)
        time.sleep(3)  # idle: the scheduler drains the canary's counter copies (settled stats line)
        engine.shutdown()
        print("ENGINE_DONE", flush=True)
""")


@pytest.mark.e2e
def test_engine_api_runs_the_canary(tmp_path):
    script = tmp_path / "engine_run.py"
    script.write_text(SCRIPT)
    env = SglangServer(device="cpu").environment()
    env.update({"TRITON_INTERPRET": "1", "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "5"})
    r = subprocess.run([sys.executable, str(script), str(write_model_dir())], env=env, capture_output=True,
                       text=True, timeout=900)
    out = r.stdout + r.stderr
    (tmp_path / "engine.log").write_text(out)
    assert r.returncode == 0 and "ENGINE_DONE" in out, out[-4000:]
    assert "ENGINE_REFUSED --kv-canary log cannot verify --enable-torch-compile" in out
    ready = parse_lines(out, READY_PREFIX)
    assert ready and ready[0]["mode"] == "raise", out[-4000:]
    stats = parse_lines(out, STATS_PREFIX)
    settled = [s for s in stats if s.get("settled") == "1"]
    assert settled, out[-4000:]
    last = settled[-1]
    n_out = [ln for ln in out.splitlines() if ln.startswith("ENGINE_OUTPUTS")][0].split()
    print(f"kv_canary_e2e_engine requests={int(n_out[1]) + 1} completion_tokens={n_out[2]} cached_tokens={n_out[3]} "
          f"slots_verified={last['slots_verified']} slots_written={last['slots_written']} "
          f"slots_swept={last['slots_swept']} violations={last['violations']}")
    assert int(n_out[1]) == 5 and int(n_out[2]) == 40 and int(n_out[3]) > 0
    assert int(last["slots_verified"]) > 0 and int(last["slots_written"]) > 0 and int(last["slots_swept"]) > 0
    assert int(last["violations"]) == 0 and parse_lines(out, VIOLATION_PREFIX) == []


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
