"""A ``/v1/score`` request with positional embedding overrides, then a plain request with the same ids: the
workload of sglang's #27472 (a scoring request's KV cached under its token ids; fixed in 0.5.22, shipped by 0.5.12)
and of the canary's embedding-override check (``kv_canary.adapter.embed_overrides``). The tiny plain model."""

from __future__ import annotations

import random

import requests

from kv_canary_testing.model_dir import FIRST_WORD_ID, NUM_WORDS
from kv_canary_testing.workload import RequestSpec, flush_cache, run_requests

PLACEHOLDER = FIRST_WORD_ID + 7  # the token id /v1/score replaces with an override vector (embed_override_token_id)
OVERRIDE_AT = (5, 15, 25)  # query positions holding the placeholder
HIDDEN = 64  # the plain tiny model's hidden size (model_dir.write_model_dir)


def score_then_generate(srv) -> dict:
    """A /v1/score request whose query carries three embedding overrides (prefill only), then /generate with the same
    50 ids and 8 more (greedy): where sglang caches the score request's KV, this hits it; then ``/flush_cache`` and
    the same /generate again, computed fresh. ``{"score": (status, body head), "hit": outcome, "fresh": outcome}``."""
    rng = random.Random(27472)
    query = [FIRST_WORD_ID + 20 + rng.randrange(NUM_WORDS - 20) for _ in range(40)]
    for p in OVERRIDE_AT:
        query[p] = PLACEHOLDER
    item = [FIRST_WORD_ID + 20 + rng.randrange(NUM_WORDS - 20) for _ in range(10)]
    overrides = [[3.0 if (i * 7 + j) % 3 else -3.0 for j in range(HIDDEN)] for i in range(len(OVERRIDE_AT))]
    r = requests.post(srv.base_url + "/v1/score", timeout=300, json={
        "query": query, "items": [item], "embed_override_token_id": PLACEHOLDER, "query_embed_overrides": overrides,
        "label_token_ids": [FIRST_WORD_ID + 1, FIRST_WORD_ID + 2]})
    words = tuple(t - FIRST_WORD_ID for t in query + item) + tuple(rng.randrange(NUM_WORDS) for _ in range(8))
    spec = RequestSpec(1, "after-score", words, 24)

    def one():
        return run_requests(srv.base_url, [spec], concurrency=1, use_input_ids=True, timeout=300).outcomes[0]

    hit = one()
    flush_cache(srv.base_url)
    return {"score": (r.status_code, r.text[:300]), "hit": hit, "fresh": one()}


# what score_then_generate's result shows, checked the same way by the real-bug runs and the CI test
HIT_TOKENS = 40  # a radix hit on at least the score request's query: its KV was cached


def check_served(result: dict, running: bool) -> None:
    assert running and result["score"][0] == 200, result["score"]
    hit, fresh = result["hit"], result["fresh"]
    assert hit.status == "ok" and fresh.status == "ok", (hit.error, fresh.error)


def check_read_override_kv(result: dict) -> None:
    """sglang's own evidence of #27472: the plain request hit the score request's tokens, and its greedy output differs
    from the same request computed fresh."""
    hit, fresh = result["hit"], result["fresh"]
    assert hit.cached_tokens >= HIT_TOKENS, f"no radix hit on the score request's tokens ({hit.cached_tokens})"
    assert hit.output_ids != fresh.output_ids, "the hit's output equals the fresh one"


def check_no_hit(result: dict) -> None:
    """Fixed: the score request's KV was not cached; the plain request computes what it computes fresh."""
    hit, fresh = result["hit"], result["fresh"]
    assert hit.cached_tokens < HIT_TOKENS and hit.output_ids == fresh.output_ids, (hit.cached_tokens, hit.output_ids)


def check_reported_at_the_reader(violations: list, result: dict) -> None:
    """The read of the override KV reported: ``token`` in the full group, naming the plain request and no other."""
    assert violations, "the read of the override KV was not reported"
    assert {v["rid"] for v in violations} == {result["hit"].rid}, violations[:3]
    assert {v["kind"] for v in violations} == {"token"} and {v["group"] for v in violations} == {"full"}, violations[:3]
