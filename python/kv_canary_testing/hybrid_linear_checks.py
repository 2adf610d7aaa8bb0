"""What both hybrid-linear e2e files assert of their ``log`` server (``test_e2e_hybrid_linear.py`` on the GPU with
sglang's own Qwen3-Next, ``test_e2e_hybrid_linear_cpu.py`` with the CPU stand-in). ``run``: the file's module
fixture, a dict with ``log`` (CanaryLog), ``by_mode`` and ``unexplained`` (``CanaryLog.injections_by_mode``)."""

from __future__ import annotations


def assert_no_false_alarm(run: dict) -> None:
    assert run["unexplained"] == [], run["unexplained"][:3]


def assert_injections_caught(run: dict) -> None:
    injected, detected = run["by_mode"].get("real_kv_used", (0, 0))
    assert injected > 0 and detected == injected, run["by_mode"]
    injected, detected = run["by_mode"].get("real_kv_post_forward", (0, 0))
    assert injected > 0 and detected > 0, run["by_mode"]


def assert_sweep_finds_unused_cache_flips(run: dict) -> None:
    log = run["log"]
    assert log.last_stat("sweeps") > 0 and log.last_stat("slots_swept") > 0
    injected, detected = run["by_mode"].get("real_kv_unused_cache", (0, 0))
    assert injected > 0, f"no real_kv_unused_cache injection: {run['by_mode']}"
    assert detected > 0, f"real_kv_unused_cache: none of {injected} caught"
    assert any(v["rid"] == "cache" and v["group"] == "full" for v in log.violations)  # rows of the sweep
