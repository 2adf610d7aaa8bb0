"""EAGLE (spec v2, topk 1) over a hybrid sliding-window target (sglang 0.5.23's ``SWAKVPool``) with ``--kv-canary
raise`` on CPU: 0 violations, the greedy outputs those of the same server with the canary off, and a sampled run
(temperature 0.8, two requests at once) served without a violation.

The servers, arguments and workload: ``kv_canary_testing.spec_cpu.swa`` (the hybrid-SWA tiny target, the tiny EAGLE
draft over its own ``MHATokenToKVPool``, page 16, ``UnifiedRadixCache``, chunked prefill at 128; prompts longer than
the window of 24, decoded past it, then radix hits on them). Two CPU servers of about four minutes each under the
Triton interpreter: by hand (``KVC_E2E_SPEC_SWA=1``), for CI time. 0.5.23 only: the other lines refuse speculative
decoding over an ``SWAKVPool`` target at startup (test_speculative_swa_refusal).
"""

import os

import pytest

from kv_canary.draft_pool import DRAFT_INSTALLED_PREFIX, DRAFT_STATS_PREFIX
from kv_canary.swa_divergence import SwaDivergenceLog
from kv_canary.violations import parse_lines
from kv_canary_testing.canary_e2e import CanaryLog, canary_server, register_cpu_ci
from kv_canary_testing.server import installed_sglang_version
from kv_canary_testing.spec_cpu.client import SPEC_ENV
from kv_canary_testing.spec_cpu.swa import (POOL_TOKENS, greedy_workload, sampled_workload, spec_swa_args,
                                           write_swa_eagle_model_dirs)

register_cpu_ci(est_time=10, suite="kv-canary-cpu")  # CI: the skip only (the servers run by hand)

BY_HAND = "KVC_E2E_SPEC_SWA"
pytestmark = [
    pytest.mark.skipif(not os.environ.get(BY_HAND), reason=f"by hand ({BY_HAND}=1): two EAGLE servers over hybrid "
                                                            "SWA, about ten minutes on CPU (CI time)"),
    pytest.mark.skipif(installed_sglang_version() != "0.5.23",
                       reason="speculative decoding over an SWAKVPool target is verified on sglang 0.5.23 only"),
]


def serve(mode, tmp_path_factory, sampled: bool):
    target, draft = write_swa_eagle_model_dirs(tmp_path_factory.mktemp("models"))
    env = {**SPEC_ENV, **({"SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL": "25"} if mode != "none" else {})}
    srv = canary_server(mode, log_path=tmp_path_factory.mktemp(mode) / "server.log", env=env, model_path=target,
                        extra_args=spec_swa_args(draft), max_total_tokens=POOL_TOKENS)
    with srv:
        out = greedy_workload(srv)
        if sampled:
            out.update(sampled_workload(srv))
        log = CanaryLog.read_settled(srv)
        running = srv.is_running()
    return out, log, running


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    off = serve("none", tmp_path_factory, sampled=False)
    on = serve("raise", tmp_path_factory, sampled=True)
    for name, (out, log, running) in (("none", off), ("raise", on)):
        print(f"kv_canary_e2e_spec_swa mode={name} running={running} "
              f"outputs={ {i: (o.status, o.verify_ct, o.cached, o.output_ids[:4]) for i, o in sorted(out.items())} } "
              f"violations={len(log.violations)} "
              + (f"stats={log.stats[-1]}" if log.stats else "(canary off: no stats line)"))
    return {"none": off, "raise": on}


@pytest.mark.e2e
def test_spec_swa_raise_has_no_violation(runs):
    out, log, running = runs["raise"]
    assert running and all(o.status == "ok" for o in out.values()), {i: o.status for i, o in out.items()}
    assert "pool=SWAKVPool groups=full,swa" in log.text
    assert log.violations == [] and log.last_stat("violations") == 0 and log.last_stat("health_violations") == 0
    assert log.last_stat("slots_verified_swa") > 0
    draft = parse_lines(log.text, DRAFT_STATS_PREFIX)
    assert draft and int(draft[-1]["violations"]) == 0 and int(draft[-1]["slots_verified"]) > 0
    # the draft's install read the target's pool through the allocator they share (SpecFacts.target_pool_name)
    installed = parse_lines(log.text, DRAFT_INSTALLED_PREFIX)
    assert installed and installed[0]["target_pool"] == "SWAKVPool" and installed[0]["pool"] == "MHATokenToKVPool"
    # the workload did what it is for: radix hits, drafts accepted, SWA slots freed out of the window
    assert all(out[10 + i].cached > 0 for i in range(3)), {i: o.cached for i, o in out.items()}
    assert any(o.verify_ct < len(o.output_ids) - 1 for o in out.values())
    div = SwaDivergenceLog.find_last(log.text)
    assert div is not None and div.swa_out_of_window_tokens > 0 and div.verify_swa > 0, div
    assert "Traceback" not in log.text


@pytest.mark.e2e
def test_spec_swa_greedy_outputs_equal_the_canary_off(runs):
    off, on = runs["none"][0], runs["raise"][0]
    assert runs["none"][2] and all(o.status == "ok" for o in off.values())
    differ = [i for i in sorted(off) if off[i].output_ids != on[i].output_ids]
    assert differ == [], differ


@pytest.mark.e2e
def test_spec_swa_sampled_requests_are_served(runs):
    out = runs["raise"][0]
    sampled = [out[i] for i in (20, 21)]
    assert all(o.status == "ok" for o in sampled), sampled


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
