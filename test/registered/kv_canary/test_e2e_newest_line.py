"""sglang 0.5.23 (the newest line): the plugin in the in-tree canary's place, on real CPU servers.

The rest of the suite (baseline, page size, perturbation modes, real data, Engine, fed positions
and tokens) runs unchanged on this line; this file checks what is particular to it:

* one canary only: sglang's own call sites drive the plugin's manager (one HEAD and one TAIL
  per forward, the startup line names the implementation and the sglang version), sglang's
  in-tree install never ran, and ``/metrics`` exports the plugin's counters;
* ``SGLANG_KV_CANARY_IMPL=in-tree`` hands ``--kv-canary`` back to sglang's own canary (which on
  CPU stops at startup with its own error: the proof that it, not the plugin, was running);
* what this line's adapter does not verify yet is refused at startup, naming the flag.
"""

import pytest
import requests

from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci
from kv_canary_testing.server import ServerError, SglangServer
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=150, suite="kv-canary-cpu")

IN_TREE_INSTALLED = "/sglang/srt/kv_canary/"  # in a traceback: sglang's own canary ran


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = canary_server("raise", log_path=tmp_path_factory.mktemp("newest") / "server.log",
                        extra_args=["--kv-canary-real-data", "partial", "--kv-canary-sweep-interval", "4",
                                    "--enable-metrics"])
    srv.start(timeout=600)
    yield srv
    srv.stop()


def _scrape(base_url):
    from prometheus_client.parser import text_string_to_metric_families

    s = requests.Session()
    s.trust_env = False
    out = {}
    for family in text_string_to_metric_families(s.get(base_url + "/metrics", timeout=60).text):
        for sample in family.samples:
            if sample.name.startswith("sglang:kv_canary_"):
                out[sample.name] = out.get(sample.name, 0) + sample.value
    return out


@pytest.mark.e2e
def test_the_plugin_serves_sglangs_call_sites_and_the_in_tree_canary_never_installs(server):
    result = run_requests(server.base_url, build_workload(30, seed=23, n_aborts=2), concurrency=8, timeout=300)
    log = CanaryLog.read_settled(server)
    metrics = _scrape(server.base_url)
    print(f"kv_canary_e2e_newest_line {result.summary()} slots_verified={log.last_stat('slots_verified')} "
          f"slots_written={log.last_stat('slots_written')} sweeps={log.last_stat('sweeps')} "
          f"forwards={log.last_stat('forwards_host')} metrics_series={len(metrics)}")
    installed = [ln for ln in log.text.splitlines() if "kv_canary_installed=1" in ln]
    assert len(installed) == 1 and "impl=sglang-kv-canary" in installed[0] and "sglang=0.5.23" in installed[0]
    assert "plugin in place of sglang 0.5.23's in-tree kv_canary" in log.text
    assert "in-tree kv_canary was about to install" not in log.text and IN_TREE_INSTALLED not in log.text
    assert result.failed == 0 and server.is_running(), "\n".join(result.errors[:5])
    assert log.violations == [] and log.last_stat("violations") == 0 and log.last_stat("health_violations") == 0
    # exactly one HEAD and one TAIL per forward: a second canary on sglang's call sites would double them
    assert log.last_stat("verify_launches") == log.last_stat("write_launches") == log.last_stat("forwards_host") > 0
    assert log.last_stat("sweeps") > 0 and log.last_stat("slots_swept") > 0
    # /metrics (--enable-metrics; 0.5.23 moved the switch to the scheduler's metrics_reporter) carries our counts
    assert metrics.get("sglang:kv_canary_slots_verified_total") == log.last_stat("slots_verified"), metrics
    assert metrics.get("sglang:kv_canary_forwards_total", 0) > 0
    assert "Traceback" not in log.text


def _start_fails(tmp_path, extra_args, env=None, timeout=300) -> str:
    srv = SglangServer(extra_args, env=env, log_path=tmp_path / "server.log")
    try:
        with pytest.raises(ServerError):
            srv.start(timeout=timeout)
        return srv.log_text()
    finally:
        srv.stop()


@pytest.mark.e2e
def test_the_in_tree_switch_hands_the_flag_back_to_sglangs_own_canary(tmp_path):
    text = _start_fails(tmp_path, ["--kv-canary", "log"], env={"SGLANG_KV_CANARY_IMPL": "in-tree"})
    assert "kv_canary plugin inactive: SGLANG_KV_CANARY_IMPL=in-tree" in text
    assert "kv_canary_installed=1" not in text
    # sglang 0.5.23's own canary does not start on CPU (its CanaryManager makes a CUDA-only Stream)
    assert IN_TREE_INSTALLED in text and "Stream.__init__() got an unexpected keyword argument 'device'" in text


@pytest.mark.e2e
@pytest.mark.parametrize("args,names", [
    # PD verifies with both sides' records hashed alike and a retraction backup that carries them (adapter/disagg)
    (["--kv-canary", "log", "--disaggregation-mode", "decode", "--kv-canary-real-data", "partial"],
     "--disaggregation-decode-retraction-backup cpu_tensor"),
    (["--kv-canary", "log", "--disaggregation-mode", "prefill"], "--kv-canary-real-data partial"),
], ids=["pd-decode-host-pool", "pd-real-data-none"])
def test_what_this_line_does_not_verify_yet_is_refused_at_startup(tmp_path, args, names):
    text = _start_fails(tmp_path, args, timeout=120)
    assert "CanaryConfigError" in text and names in text, text[-3000:]
    assert "kv_canary_installed=1" not in text


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
