"""Concurrent mixed /generate traffic against a sglang server.

The request plan is deterministic for a seed and mixes:

* ``shared``: one of a few long shared prefixes plus a unique suffix (radix-cache hits);
* ``long``: prompts longer than the chunked-prefill size (chunked prefill), some of
  them starting with a shared prefix;
* ``short``: short unique prompts;
* ``abort``: streamed requests aborted after a few chunks. Two ways, chosen by
  ``abort_mode``: ``"disconnect"`` closes the connection (sglang aborts the
  request about 2 s later, from the response's background task), ``"api"`` posts
  ``/abort_request`` with the request's rid and reads the stream to its end,
  requiring ``finish_reason`` ``abort`` (proof that it was cut mid-generation).
  ``"mixed"`` (default) alternates the two, starting with a disconnect.

All requests use ``ignore_eos`` and temperature 0 unless ``temperature`` is given (sampling then draws from
sglang's seeded generator: ``--random-seed``); ``max_new_tokens`` is small to keep CPU time low. Prompts are made of the tiny tokenizer's words (``w0`` ..),
one token per word; they are sent as text, or as ``input_ids`` if asked.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import requests

from kv_canary_testing.model_dir import NUM_WORDS, word, word_token_id


ABORT_MODES = ("mixed", "disconnect", "api")
# sglang 0.5.12 aborts a disconnected stream from a background task that first sleeps 2 s.
DISCONNECT_ABORT_DELAY_S = 2.0
# Releases that never abort a disconnected stream (stock sglang, canary off too: docs/compatibility.md): their
# TokenizerManager.generate_request drops the rid's state on the disconnect (``except BaseException`` ->
# ``_discard_pending_req_states``), so the abort task finds no state and sends the scheduler nothing; the request
# decodes to its max_new_tokens while its reservation stalls the queue. Their workloads abort through the API only.
DISCONNECT_ABORT_LOST = ("0.5.18", "0.5.19")


def abort_mode_for(release) -> str:
    """``"mixed"``, or ``"api"`` on a release in ``DISCONNECT_ABORT_LOST``."""
    return "api" if release in DISCONNECT_ABORT_LOST else "mixed"


@dataclass(frozen=True)
class RequestSpec:
    """One planned request; ``words`` are word indices (token id = word_token_id(i))."""

    index: int
    kind: str  # "shared" | "long" | "short" | "abort"
    words: tuple[int, ...]
    max_new_tokens: int
    abort_after_chunks: int | None = None

    def text(self) -> str:
        return " ".join(word(i) for i in self.words)

    def input_ids(self) -> list[int]:
        return [word_token_id(i) for i in self.words]


@dataclass
class RequestOutcome:
    """What happened to one request."""

    index: int
    kind: str
    status: str  # "ok" | "aborted" | "failed"
    rid: str = ""
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    latency_s: float = 0.0


@dataclass
class WorkloadResult:
    """Counts and per-request outcomes of a workload run."""

    sent: int = 0
    succeeded: int = 0
    aborted: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    outcomes: list[RequestOutcome] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no request failed unexpectedly."""
        return self.failed == 0

    @property
    def uncached_prompt_tokens(self) -> int:
        """Prompt tokens that had to be prefilled (not radix-cache hits) by completed requests.

        Those tokens all entered the radix cache; when this exceeds the server's
        ``--max-total-tokens``, the cache must have evicted.
        """
        return self.prompt_tokens - self.cached_tokens

    def outputs(self) -> dict[int, list[int]]:
        """Output token ids of the requests that completed, by request index."""
        return {o.index: o.output_ids for o in self.outcomes if o.status == "ok"}

    def summary(self) -> str:
        return (
            f"sent={self.sent} succeeded={self.succeeded} aborted={self.aborted} "
            f"failed={self.failed} prompt_tokens={self.prompt_tokens} "
            f"cached_tokens={self.cached_tokens} uncached={self.uncached_prompt_tokens} "
            f"completion_tokens={self.completion_tokens} "
            f"elapsed={self.elapsed_s:.1f}s"
        )


def _random_words(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(NUM_WORDS) for _ in range(n))


def build_workload(
    n_requests: int = 200,
    seed: int = 0,
    *,
    n_prefixes: int = 4,
    prefix_len: tuple[int, int] = (64, 192),
    suffix_len: tuple[int, int] = (4, 48),
    short_len: tuple[int, int] = (4, 64),
    long_len: tuple[int, int] = (300, 520),
    max_new_tokens: tuple[int, int] = (4, 16),
    fractions: dict[str, float] | None = None,
    n_aborts: int | None = None,
    abort_after_chunks: int = 3,
    abort_max_new_tokens: int = 1024,
) -> list[RequestSpec]:
    """Return a deterministic request plan.

    ``fractions`` weights the kinds shared/long/short (default 0.5/0.2/0.3);
    ``n_aborts`` defaults to 5% of the requests (at least 1).
    """
    if n_requests < 1:
        raise ValueError("n_requests must be >= 1")
    rng = random.Random(seed)
    weights = {"shared": 0.5, "long": 0.2, "short": 0.3}
    weights.update(fractions or {})
    if n_aborts is None:
        n_aborts = max(1, round(0.05 * n_requests)) if n_requests > 1 else 0
    n_aborts = min(n_aborts, n_requests)
    prefixes = [_random_words(rng, rng.randint(*prefix_len)) for _ in range(max(1, n_prefixes))]
    kinds = list(weights)
    abort_slots = set(rng.sample(range(n_requests), n_aborts))

    specs = []
    for i in range(n_requests):
        new_tokens = rng.randint(*max_new_tokens)
        if i in abort_slots:
            words = rng.choice(prefixes) + _random_words(rng, rng.randint(*suffix_len))
            specs.append(RequestSpec(i, "abort", words, abort_max_new_tokens, abort_after_chunks))
            continue
        kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
        if kind == "shared":
            words = rng.choice(prefixes) + _random_words(rng, rng.randint(*suffix_len))
        elif kind == "long":
            total = rng.randint(*long_len)
            head = rng.choice(prefixes) if rng.random() < 0.5 else ()
            words = head + _random_words(rng, max(1, total - len(head)))
        else:
            words = _random_words(rng, rng.randint(*short_len))
        specs.append(RequestSpec(i, kind, words, new_tokens))
    return specs


class _Client:
    def __init__(self, base_url: str, use_input_ids: bool, timeout: float, abort_mode: str,
                 temperature: float = 0.0):
        if abort_mode not in ABORT_MODES:
            raise ValueError(f"abort_mode must be one of {ABORT_MODES}, not {abort_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.use_input_ids = use_input_ids
        self.timeout = timeout
        self.abort_mode = abort_mode
        self.temperature = temperature
        self.run_id = uuid.uuid4().hex[:8]
        self._local = threading.local()

    def rid(self, spec: RequestSpec) -> str:
        # Fixed width: sglang's /abort_request aborts every request whose rid
        # *starts with* the given rid, so no rid may be a prefix of another.
        return f"kvc-{self.run_id}-{spec.index:08d}"

    def plan(self, specs: Sequence[RequestSpec]) -> None:
        """Number the abort requests, so "mixed" alternates disconnect/api among them."""
        aborts = [s.index for s in specs if s.abort_after_chunks is not None]
        self._abort_ordinal = {idx: n for n, idx in enumerate(aborts)}

    def abort_how(self, spec: RequestSpec) -> str:
        if self.abort_mode == "mixed":
            n = getattr(self, "_abort_ordinal", {}).get(spec.index, spec.index)
            return "disconnect" if n % 2 == 0 else "api"
        return self.abort_mode

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            s.trust_env = False  # loopback only: never go through a proxy
            self._local.session = s
        return s

    def _payload(self, spec: RequestSpec, stream: bool) -> dict:
        payload = {
            "sampling_params": {
                "max_new_tokens": spec.max_new_tokens,
                "temperature": self.temperature,
                "ignore_eos": True,
            },
            "stream": stream,
            "rid": self.rid(spec),
        }
        if self.use_input_ids:
            payload["input_ids"] = spec.input_ids()
        else:
            payload["text"] = spec.text()
        return payload

    def run(self, spec: RequestSpec) -> RequestOutcome:
        t0 = time.monotonic()
        try:
            if spec.abort_after_chunks is not None:
                out = self._run_abort(spec)
            else:
                out = self._run_plain(spec)
        except Exception as e:  # network errors, bad JSON, ...
            out = RequestOutcome(spec.index, spec.kind, "failed",
                                 error=f"{type(e).__name__}: {e}")
        out.rid = self.rid(spec)
        out.latency_s = time.monotonic() - t0
        return out

    def _run_plain(self, spec: RequestSpec) -> RequestOutcome:
        r = self._session().post(
            self.base_url + "/generate", json=self._payload(spec, False), timeout=self.timeout
        )
        if r.status_code != 200:
            return RequestOutcome(spec.index, spec.kind, "failed",
                                  error=f"HTTP {r.status_code}: {r.text[:300]}")
        body = r.json()
        meta = body.get("meta_info") or {}
        ids = list(body.get("output_ids") or [])
        out = RequestOutcome(
            spec.index, spec.kind, "ok", output_ids=ids, text=body.get("text") or "",
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            cached_tokens=int(meta.get("cached_tokens") or 0),
        )
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish != "length" or len(ids) != spec.max_new_tokens:
            out.status = "failed"
            out.error = (f"finish_reason={meta.get('finish_reason')!r}, "
                         f"{len(ids)} of {spec.max_new_tokens} tokens")
        return out

    def _run_abort(self, spec: RequestSpec) -> RequestOutcome:
        # A fresh connection (no pooled session): closing it is what makes sglang abort.
        r = requests.post(
            self.base_url + "/generate", json=self._payload(spec, True),
            stream=True, timeout=self.timeout,
        )
        how = self.abort_how(spec)
        try:
            if r.status_code != 200:
                return RequestOutcome(spec.index, spec.kind, "failed",
                                      error=f"HTTP {r.status_code}: {r.text[:300]}")
            if spec.abort_after_chunks == 0 and how == "disconnect":
                # gone once the response started, before any token: the request is aborted mid-prefill (or, with
                # PD, while its KV is in flight to the decode server)
                return RequestOutcome(spec.index, spec.kind, "aborted")
            chunks = 0
            abort_sent = False
            last = {}
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                last = json.loads(data)
                if "error" in last:
                    return RequestOutcome(spec.index, spec.kind, "failed",
                                          error=f"stream error: {last['error']}")
                chunks += 1
                if chunks >= spec.abort_after_chunks and not abort_sent:
                    if how == "disconnect":
                        return RequestOutcome(spec.index, spec.kind, "aborted")
                    a = self._session().post(self.base_url + "/abort_request",
                                             json={"rid": self.rid(spec)}, timeout=self.timeout)
                    if a.status_code != 200:
                        return RequestOutcome(spec.index, spec.kind, "failed",
                                              error=f"/abort_request HTTP {a.status_code}")
                    abort_sent = True
            finish = ((last.get("meta_info") or {}).get("finish_reason") or {}).get("type")
            if abort_sent and finish == "abort":
                return RequestOutcome(spec.index, spec.kind, "aborted")
            return RequestOutcome(
                spec.index, spec.kind, "failed",
                error=f"stream ended after {chunks} chunks with finish_reason={finish!r}"
                      f" (abort {'sent' if abort_sent else 'not sent'})",
            )
        finally:
            r.close()


def run_requests(
    base_url: str,
    specs: Sequence[RequestSpec],
    concurrency: int = 16,
    *,
    use_input_ids: bool = False,
    timeout: float = 120.0,
    abort_mode: str = "mixed",
    settle: bool = True,
    temperature: float = 0.0,
) -> WorkloadResult:
    """Send ``specs`` with ``concurrency`` threads and collect a WorkloadResult.

    With ``settle`` and disconnect-aborts in the plan, wait until sglang's delayed
    abort of the last disconnected stream has fired before returning.
    """
    client = _Client(base_url, use_input_ids, timeout, abort_mode, temperature)
    client.plan(specs)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        outcomes = list(pool.map(client.run, specs))
    disconnects = [s for s in specs
                   if s.abort_after_chunks is not None and client.abort_how(s) == "disconnect"]
    if settle and disconnects:
        time.sleep(DISCONNECT_ABORT_DELAY_S + 1.0)
    result = WorkloadResult(elapsed_s=time.monotonic() - t0, outcomes=outcomes)
    result.sent = len(outcomes)
    for o in outcomes:
        if o.status == "ok":
            result.succeeded += 1
            result.prompt_tokens += o.prompt_tokens
            result.cached_tokens += o.cached_tokens
            result.completion_tokens += len(o.output_ids)
        elif o.status == "aborted":
            result.aborted += 1
        else:
            result.failed += 1
            result.errors.append(f"request {o.index} ({o.kind}): {o.error}")
    return result


def run_mixed_workload(
    base_url: str,
    n_requests: int = 200,
    concurrency: int = 16,
    seed: int = 0,
    *,
    use_input_ids: bool = False,
    timeout: float = 120.0,
    abort_mode: str = "mixed",
    settle: bool = True,
    **plan_kwargs,
) -> WorkloadResult:
    """Build the plan with ``build_workload(n_requests, seed, **plan_kwargs)`` and run it."""
    specs = build_workload(n_requests, seed, **plan_kwargs)
    return run_requests(base_url, specs, concurrency, use_input_ids=use_input_ids,
                        timeout=timeout, abort_mode=abort_mode, settle=settle)


def run_embeddings(base_url: str, specs: Sequence[RequestSpec], concurrency: int = 4, *,
                   timeout: float = 120.0, rid_prefix: str = "kvc-emb-") -> dict[int, list[float] | str]:
    """POST each spec's ``input_ids`` to sglang's ``/encode`` (a server started with ``--is-embedding``) as request
    ``rid_prefix + index``, with ``concurrency`` threads: ``{spec.index: embedding}``, or the error text for a
    request that failed."""

    def one(spec: RequestSpec):
        s = requests.Session()
        s.trust_env = False  # loopback only
        try:
            r = s.post(base_url + "/encode", json={"input_ids": spec.input_ids(), "rid": f"{rid_prefix}{spec.index}"},
                       timeout=timeout)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code != 200 or "embedding" not in body:
                return spec.index, f"HTTP {r.status_code}: {r.text[:300]}"
            return spec.index, [float(x) for x in body["embedding"]]
        except requests.RequestException as e:
            return spec.index, f"{type(e).__name__}: {e}"
        finally:
            s.close()

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return dict(pool.map(one, specs))


def flush_cache(base_url: str, timeout: float = 60.0) -> None:
    """sglang's ``/flush_cache`` (the tree, the device and the host pools reset; refused while busy: retried)."""
    session = requests.Session()
    session.trust_env = False
    deadline = time.monotonic() + timeout
    while True:
        r = session.post(f"{base_url}/flush_cache", timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache: HTTP {r.status_code} {r.text[:200]}")
