"""PD disaggregation with tensor parallel (``--tp-size 2`` on both sides, sglang 0.5.23): each rank's KV manager
registers its own shard's records, so every decode rank verifies the shard its prefill peer sent.

One deployment: prefill ``raise`` (it stays clean), decode ``log`` with a transfer perturbation on rank 1 only
(``SGLANG_KV_CANARY_PERTURB_TP_RANK=1``: bytes of rank 1's received shard flipped right after arrival). Every
injection is a rank-1 ``kv_hash`` violation on the flipped slot, rank 0 sees nothing, both decode ranks verified
every slot they received, serving goes on. CPU as in ``test_e2e_tp`` (``KvcTinyTpForCausalLM``, the cores split
over the ranks, no NCCL library: ``ranks.cpu_tp_env``; both servers' ranks share the machine's cores).
"""

from __future__ import annotations

import pytest

from kv_canary.violations import PERTURB_PREFIX, STATS_PREFIX, VIOLATION_PREFIX, parse_lines
from kv_canary_testing.canary_e2e import MAX_TOTAL_TOKENS, canary_env_and_args, e2e_device, register_cpu_ci
from kv_canary_testing.model_dir import write_model_dir
from kv_canary_testing.pd import PDCluster, pd_skip_reason
from kv_canary_testing.ranks import by_rank, cpu_tp_env, settled_by_rank
from kv_canary_testing.workload import build_workload, run_requests

register_cpu_ci(est_time=300, suite="kv-canary-cpu")

pytestmark = [
    pytest.mark.skipif(e2e_device() == "cuda", reason="PD with --tp-size 2 on both sides needs four GPUs on one "
                       "host and the 0.5.23 PD bundle for the GPU host (issue 52); CPU CI runs it"),
    pytest.mark.skipif(pd_skip_reason("cpu") is not None, reason=str(pd_skip_reason("cpu"))),
]

TRANSFER = {"SGLANG_KV_CANARY_PERTURB_TRANSFER_PROB": "0.2", "SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS": "2",
            "SGLANG_KV_CANARY_PERTURB_SEED": "5", "SGLANG_KV_CANARY_PERTURB_KV_BYTES": "hashed",
            "SGLANG_KV_CANARY_PERTURB_TP_RANK": "1"}
TP = ["--tp-size", "2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = write_model_dir(tmp_path_factory.mktemp("pd-tp-tiny"), config_overrides={
        "architectures": ["KvcTinyTpForCausalLM"]})
    p_env, p_args = canary_env_and_args("raise", cpu_tp_env(), TP, "cpu", 20, "torch")
    d_env, d_args = canary_env_and_args("log", {**cpu_tp_env(), **TRANSFER}, TP, "cpu", 20, "torch")
    c = PDCluster(log_dir=tmp_path_factory.mktemp("pd-tp"), prefill_args=p_args, decode_args=d_args, prefill_env=p_env,
                  decode_env=d_env, device="cpu", max_total_tokens=MAX_TOTAL_TOKENS["cpu"], model_path=model)
    c.start(timeout=900)
    yield c
    c.stop()


@pytest.mark.e2e
def test_each_decode_rank_verifies_the_shard_it_received(cluster):
    specs = build_workload(20, seed=2027, n_aborts=2, long_len=(150, 260))
    result = run_requests(cluster.base_url, specs, concurrency=6, abort_mode="disconnect", timeout=600)
    p_text, p_stats = settled_by_rank(cluster.prefill, ("0", "1"), "tp_rank")
    d_text, d_stats = settled_by_rank(cluster.decode, ("0", "1"), "tp_rank")
    injections = by_rank([i for i in parse_lines(d_text, PERTURB_PREFIX) if i[PERTURB_PREFIX] == "transfer"], "tp_rank")
    violations = by_rank(parse_lines(d_text, VIOLATION_PREFIX), "tp_rank")
    last = {r: d_stats[r][-1] for r in ("0", "1")}
    print(f"kv_canary_e2e_pd_tp {result.summary()} injections_rank1={len(injections.get('1', []))} "
          f"violations_rank0={len(violations.get('0', []))} violations_rank1={len(violations.get('1', []))} "
          + " ".join(f"rank{r}_pd_slots_received={last[r]['pd_slots_received']} "
                     f"rank{r}_pd_slots_verified={last[r]['pd_slots_verified']}" for r in last))
    assert result.failed == 0, "\n".join(result.errors[:5]) + "\n" + cluster.decode.log_tail()
    assert result.succeeded == len(specs) - 2 and result.cached_tokens > 0
    assert cluster.prefill.is_running() and cluster.decode.is_running()  # log: serving goes on
    # both sides' ranks carried their records: two canary buffers in each rank's transfer
    assert p_text.count("kv_canary_pd=prefill") >= 2 and d_text.count("kv_canary_pd=decode") >= 2
    assert parse_lines(p_text, VIOLATION_PREFIX) == []  # the prefill (raise) stays clean on both ranks
    assert all(int(p_stats[r][-1]["violations"]) == 0 for r in ("0", "1"))
    # every decode rank verified every slot it received (its shard of every transferred prompt)
    for r in ("0", "1"):
        assert int(last[r]["pd_slots_received"]) > 0
        assert last[r]["pd_slots_verified"] == last[r]["pd_slots_received"] == last["0"]["pd_slots_received"]
    # rank 1's flipped shard is found on rank 1, at the flipped slot; rank 0's shard is intact
    assert set(injections) == {"1"}, injections.keys()
    assert "0" not in violations and violations.get("1")
    for i in injections["1"]:
        assert any(v["slot"] == i["slot"] and v["rid"] == i["rid"] and int(v["forward"]) >= int(i["forward"])
                   and "kv_hash" in v["kind"] for v in violations["1"]), i
    flipped = {(i["slot"], i["rid"]) for i in injections["1"]}
    assert all((v["slot"], v["rid"]) in flipped for v in violations["1"]), violations["1"][:3]
    assert STATS_PREFIX in d_text and "Traceback" not in p_text + d_text


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-s"]))
