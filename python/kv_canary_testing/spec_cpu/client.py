"""One ``/generate`` call to an EAGLE test server on CPU and what came back, shared by the speculative real-bug runs
(test_e2e_real_bugs_spec_0523) and the hybrid-SWA EAGLE e2e (``spec_cpu.swa``)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import requests

SPEC_ENV = {"SGLANG_EXTERNAL_MODEL_PACKAGE": "kv_canary_testing.spec_cpu"}  # the tiny target and draft classes


class Out(NamedTuple):
    status: str  # "ok": every asked token came back
    output_ids: list
    verify_ct: int  # sglang's spec_verify_ct: verify rounds (fewer rounds for the same tokens: more drafts accepted)
    cached: int  # sglang's cached_tokens (radix hit)


def generate(srv, ids: Sequence[int], n: int, temperature: float = 0.0) -> Out:
    """``n`` new tokens after ``ids`` (a session that ignores proxy variables: loopback only)."""
    s = requests.Session()
    s.trust_env = False
    r = s.post(srv.base_url + "/generate", timeout=600, json={
        "input_ids": list(ids), "sampling_params": {"max_new_tokens": n, "temperature": temperature}})
    if r.status_code != 200:
        return Out(f"HTTP {r.status_code}", [], 0, 0)
    body = r.json()
    out_ids = list(body.get("output_ids") or [])
    meta = body.get("meta_info") or {}
    return Out("ok" if len(out_ids) == n else "short", out_ids, int(meta.get("spec_verify_ct") or 0),
               int(meta.get("cached_tokens") or 0))
