"""PD disaggregation end to end: prefill + decode + router (mooncake over TCP on loopback).

The canary's records travel with the KV, so the decode side verifies what the
prefill wrote, and its own TAIL writes continue the same chain:

* clean: ``--kv-canary raise`` on both sides, mixed workload (shared prefixes,
  prompts longer than the chunk size, aborts) -> every request succeeds, zero
  violations, and the decode side verified the slots it received by transfer;
* log: the prefill flips K/V bytes of slots it just wrote (``real_kv_post_forward``,
  the seed's case) and the decode side flips bytes of slots right after they
  arrive (``transfer``) -> every injection is a decode-side ``kv_hash``
  violation naming the bootstrap room and the prefill slot it came from, the
  prefill side stays clean, serving continues;
* raise (same prefill, the decode server restarted with ``raise``): the first
  corrupted slot stops the decode server with the report; the prefill keeps serving.

Two deployments (clean; perturbed) and one decode restart keep the startup cost down.
"""

import random

import pytest

from kv_canary_testing.canary_e2e import (
    CHUNKED_PREFILL_SIZE,
    CanaryLog,
    canary_pd_cluster,
    e2e_device,
    restart_canary_decode,
    register_cpu_ci,
    register_cuda_ci,
)
from kv_canary_testing.line_suites import installed_line
from kv_canary_testing.pd import pd_skip_reason
from kv_canary_testing.workload import RequestSpec, build_workload, run_requests

register_cpu_ci(est_time=420, suite="kv-canary-cpu")
register_cuda_ci(est_time=600, suite="kv-canary-cuda")

pytestmark = pytest.mark.skipif(pd_skip_reason(e2e_device()) is not None, reason=str(pd_skip_reason(e2e_device())))

POST_FORWARD = "SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB"
TRANSFER = "SGLANG_KV_CANARY_PERTURB_TRANSFER_PROB"
# Flips land inside the hashed window (the default real-data mode hashes a window of each slot): every
# injection must then be caught; flips anywhere in the slot are test_e2e_real_data's subject.
PERTURB_COMMON = {"SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "2", "SGLANG_KV_CANARY_PERTURB_SEED": "5",
                  "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed"}
# The prefill side runs without its radix cache in the perturbation runs, and with a chunk budget above a whole
# batch of these prompts (--chunked-prefill-size bounds the tokens of a prefill *batch*: with 128 the last request
# of a batch is split, and its next chunk reads what the previous forward wrote): a slot the prefill corrupts after
# its TAIL is then read by nobody on the prefill side, only by the decode side after the transfer (the seed's
# case: the prefill stays clean).
PREFILL_NO_SHARING = ["--disable-radix-cache", "--chunked-prefill-size", "8192"]
# sglang 0.5.23's PD is verified at page size 16 too (SglangLine.pd_page_sizes): its perturbed deployment runs there
# (whole pages travel; the records of a page's unfilled tail travel with it and are never read), the clean one at 1
PERTURBED_PAGE = ["--page-size", "16"] if installed_line() == "0.5.23" else []
N_SERIAL = 12  # perturbed run: requests sent one at a time before the concurrent rest


def unique_short_requests(n, seed, max_new_tokens=6):
    """Prompts shorter than a chunk, each starting with its own word."""
    rng = random.Random(seed)
    return [RequestSpec(i, "short", (i, *(rng.randrange(508) for _ in range(rng.randrange(8, 60)))), max_new_tokens)
            for i in range(n)]


def _cluster(request, tmp_path_factory, name, **kwargs):
    reason = pd_skip_reason(e2e_device())
    if reason:
        pytest.skip(reason)
    cluster = canary_pd_cluster(log_dir=tmp_path_factory.mktemp(name), **kwargs)
    cluster.start(timeout=900)
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture(scope="class")
def clean(request, tmp_path_factory):
    # The decode server runs sglang's PD warmup: a *fake* transfer (nothing is sent) followed by decode
    # forwards that read never-written KV; the canary must fingerprint it in place, not stop the server.
    return _cluster(request, tmp_path_factory, "pd-clean", prefill_mode="raise", decode_mode="raise",
                    decode_drop_default_args=["--skip-server-warmup"])


@pytest.fixture(scope="class")
def perturbed(request, tmp_path_factory):
    return _cluster(request, tmp_path_factory, "pd-perturbed", prefill_mode="log", decode_mode="log",
                    prefill_env={POST_FORWARD: "0.3", **PERTURB_COMMON},
                    decode_env={TRANSFER: "0.15", **PERTURB_COMMON},
                    prefill_args=PREFILL_NO_SHARING + PERTURBED_PAGE, decode_args=PERTURBED_PAGE)


def explained_by_prefill(violation, injection) -> bool:
    """A decode violation on a slot that came from the prefill slot this injection flipped."""
    return violation.get("origin_slot") == injection["slot"] and "kv_hash" in violation["kind"]


def explained_by_transfer(violation, injection) -> bool:
    return (violation["slot"], violation["rid"]) == (injection["slot"], injection["rid"]) and int(
        violation["forward"]) >= int(injection["forward"]) and "kv_hash" in violation["kind"]


@pytest.mark.e2e
class TestPDClean:
    N_REQUESTS = 28
    N_ABORTS = 3

    def test_mixed_workload_verifies_transferred_slots_with_no_violation(self, clean):
        specs = build_workload(self.N_REQUESTS, seed=2027, n_aborts=self.N_ABORTS, long_len=(150, 260))
        result = run_requests(clean.base_url, specs, concurrency=8, abort_mode="disconnect", timeout=600)
        p, d = CanaryLog.read_settled(clean.prefill), CanaryLog.read_settled(clean.decode)
        print(f"kv_canary_e2e_pd_clean device={e2e_device()} startup={clean.startup_seconds:.0f}s {result.summary()} "
              f"prefill_slots_written={p.last_stat('slots_written')} prefill_slots_verified="
              f"{p.last_stat('slots_verified')} decode_slots_verified={d.last_stat('slots_verified')} "
              f"decode_slots_written={d.last_stat('slots_written')} "
              f"pd_requests_received={d.last_stat('pd_requests_received')} "
              f"pd_slots_received={d.last_stat('pd_slots_received')} "
              f"pd_slots_verified={d.last_stat('pd_slots_verified')} pd_fake_requests="
              f"{d.last_stat('pd_fake_requests')} decode_graph_forwards={d.last_stat('graph_forwards')} "
              f"violations={len(p.violations)}+{len(d.violations)}")
        assert p.installed and d.installed
        assert "kv_canary_pd=prefill" in p.text and "kv_canary_pd=decode" in d.text
        assert result.failed == 0, "\n".join(result.errors[:5]) + "\n" + clean.decode.log_tail()
        assert result.aborted == self.N_ABORTS and result.succeeded == self.N_REQUESTS - self.N_ABORTS
        # the workload exercised prefix sharing (prefill radix cache) and chunked prefill before the transfer
        assert result.cached_tokens > 0
        assert max(o.prompt_tokens for o in result.outcomes) > CHUNKED_PREFILL_SIZE
        assert clean.prefill.is_running() and clean.decode.is_running()
        assert p.violations == [] and d.violations == [], (p.violations + d.violations)[:5]
        for log in (p, d):
            assert log.last_stat("violations") == 0 and log.last_stat("health_violations") == 0
            assert log.last_stat("verify_launches") == log.last_stat("write_launches") == log.last_stat(
                "forwards_host")
        # every completed request's prompt arrived by transfer, and its first decode forward verified it
        completed_prompt_tokens = sum(o.prompt_tokens for o in result.outcomes if o.status == "ok")
        assert d.last_stat("pd_requests_received") >= result.succeeded
        assert d.last_stat("pd_slots_received") >= completed_prompt_tokens
        assert d.last_stat("pd_slots_verified") >= completed_prompt_tokens
        assert d.last_stat("slots_verified") >= d.last_stat("pd_slots_verified")
        assert d.last_stat("pd_fake_requests") >= 1 and "pd disaggregation warmup" in d.text  # sglang's warmup
        if e2e_device() == "cuda":  # the first reads of transferred slots ran inside decode graph replays
            assert d.last_stat("graph_forwards") > 0
        assert "Traceback" not in p.text + d.text and "kv_canary_jit_after_startup" not in p.text + d.text

    def test_aborts_while_the_kv_is_in_flight_leave_nothing_that_accuses_the_next_owner(self, clean):
        """Requests dropped right after their response starts (mid-prefill or mid-transfer), with short requests
        sent beside and after them into the slots they freed: no violation on either side (``raise``), every
        short request served, both servers up."""
        before = CanaryLog.read_settled(clean.decode)
        rng = random.Random(29)
        dropped = [RequestSpec(i, "abort", tuple(rng.randrange(508) for _ in range(rng.randrange(300, 480))), 64,
                               abort_after_chunks=0) for i in range(10)]
        after = unique_short_requests(24, seed=30)
        after = [RequestSpec(100 + s.index, s.kind, s.words, s.max_new_tokens) for s in after]
        result = run_requests(clean.base_url, dropped + after, concurrency=8, abort_mode="disconnect", timeout=600)
        p, d = CanaryLog.read_settled(clean.prefill), CanaryLog.read_settled(clean.decode)
        received = d.last_stat("pd_requests_received") - before.last_stat("pd_requests_received")
        print(f"kv_canary_e2e_pd_aborts_in_flight {result.summary()} decode_requests_received={received} "
              f"(of {len(dropped) + len(after)} sent) violations={len(p.violations)}+{len(d.violations)}")
        assert result.failed == 0, "\n".join(result.errors[:5]) + "\n" + clean.decode.log_tail()
        assert result.aborted == len(dropped) and result.succeeded == len(after)
        assert clean.prefill.is_running() and clean.decode.is_running()
        assert p.violations == [] and d.violations == [], (p.violations + d.violations)[:5]
        assert d.last_stat("violations") == 0 and p.last_stat("violations") == 0


@pytest.mark.e2e
class TestPDPerturbed:
    def test_log_prefill_and_transfer_corruption_surface_on_the_decode_side(self, perturbed):
        specs = unique_short_requests(40, seed=11)
        # The first requests one at a time: each is then one prefill forward and one decode arrival, in the same
        # order on both sides, and the two servers' perturbation streams (both seed 5) line up -- the CI run's
        # coincidence (issue 10): a prefill flip and a transfer flip of the same byte of the same request.
        serial = run_requests(perturbed.base_url, specs[:N_SERIAL], concurrency=1, timeout=600)
        result = run_requests(perturbed.base_url, specs[N_SERIAL:], concurrency=6, timeout=600)
        p, d = CanaryLog.read_settled(perturbed.prefill), CanaryLog.read_settled(perturbed.decode)
        pre = [i for i in p.perturbations if i["kv_canary_perturb"] == "real_kv_post_forward"]
        xfer = [i for i in d.perturbations if i["kv_canary_perturb"] == "transfer"]
        missed_pre = [i for i in pre if not any(explained_by_prefill(v, i) for v in d.violations)]
        missed_xfer = [i for i in xfer if not any(explained_by_transfer(v, i) for v in d.violations)]
        unexplained = [v for v in d.violations if not any(explained_by_prefill(v, i) for i in pre)
                       and not any(explained_by_transfer(v, i) for i in xfer)]
        print(f"kv_canary_e2e_pd_log startup={perturbed.startup_seconds:.0f}s serial: {serial.summary()} "
              f"concurrent: {result.summary()} "
              f"prefill_injections={len(pre)} caught_on_decode={len(pre) - len(missed_pre)} "
              f"transfer_injections={len(xfer)} caught={len(xfer) - len(missed_xfer)} "
              f"decode_violations={len(d.violations)} prefill_violations={len(p.violations)} "
              f"pd_slots_verified={d.last_stat('pd_slots_verified')}")
        assert serial.failed == result.failed == 0, "\n".join((serial.errors + result.errors)[:5])
        assert perturbed.prefill.is_running() and perturbed.decode.is_running()  # log mode: serving goes on
        assert pre and xfer, "no injection happened"
        assert p.violations == [], p.violations[:3]  # the prefill side stays clean
        # Every injection lands in a slot a later forward reads (no aborts, ignore_eos, max_new_tokens 6, and the
        # prefill's gate opens after its health check and the startup request): every one must be caught. Both
        # servers draw from seed 5 (mirrored streams): a prefill flip and a transfer flip can hit the same byte of
        # the same request (CI, issue 10); the transfer mode's own XOR mask keeps that byte changed, and the one
        # violation then explains both injections.
        both = [i for i in xfer if any(explained_by_transfer(v, i) and any(explained_by_prefill(v, j) for j in pre)
                                       for v in d.violations)]
        print(f"kv_canary_e2e_pd_same_slot_injections={len(both)}")
        assert missed_pre == [] and missed_xfer == [], (
            f"kv_canary_e2e_pd_missed prefill={[(i['slot'], i['forward']) for i in missed_pre]} "
            f"transfer={[(i['slot'], i['forward']) for i in missed_xfer]}")
        assert unexplained == [], unexplained[:3]
        # identity: the decode line names the decode rid, the bootstrap room, and the prefill room and slot
        # (the workload sends its own rid, which the router forwards to both sides)
        for v in d.violations:
            assert v["rid"].startswith("kvc-") and v["origin_room"] == v["bootstrap_room"] and "origin_slot" in v

    def test_raise_the_decode_server_stops_with_the_report(self, perturbed):
        # no end-to-end startup request: the perturbed prefill may corrupt any request, and the first one
        # to reach this decode server must be the test's
        decode = restart_canary_decode(perturbed, "raise", decode_env={TRANSFER: "1", **PERTURB_COMMON},
                                       decode_args=PERTURBED_PAGE, wait_generate=False)
        result = run_requests(perturbed.base_url, unique_short_requests(12, seed=12), concurrency=4, timeout=300)
        code = decode.wait_exit(timeout=120)
        p, d = CanaryLog.read_settled(perturbed.prefill), CanaryLog.read(decode)
        pre = [i for i in p.perturbations if i["kv_canary_perturb"] == "real_kv_post_forward"]
        xfer = [i for i in d.perturbations if i["kv_canary_perturb"] == "transfer"]
        print(f"kv_canary_e2e_pd_raise {result.summary()} decode_exit={code} transfer_injections={len(xfer)} "
              f"decode_violations={len(d.violations)}")
        assert code != 0 and "CanaryViolationError" in d.text
        assert d.violations and all(any(explained_by_prefill(v, i) for i in pre)
                                    or any(explained_by_transfer(v, i) for i in xfer) for v in d.violations)
        assert result.failed > 0  # in-flight requests failed instead of hanging
        assert perturbed.prefill.is_running() and p.violations == []


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
