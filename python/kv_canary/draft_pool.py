"""The EAGLE draft model's own KV pool: its canary config, its manager, its token convention.

sglang 0.5.12's EAGLE draft worker (spec v2, ``EagleDraftWorker``) shares the target's
``req_to_token`` table and slot allocator but owns its own KV pool: slot ``s`` of the draft
pool belongs to the same request position as slot ``s`` of the target pool. The draft pool
gets its own buffer group (``draft``), records, counters and violation ring: a separate
``DraftCanaryManager`` with ``max(1, speculative_num_steps - 1)`` single-forward managers
(one per draft decode step, ``draft_forward``'s loop), whose lines are
``kv_canary_draft_stats=`` (the target's stay ``kv_canary_stats=``).

**Token convention** (``KV_TOKEN_ID_VS_POSITION_OFFSET = 1``, the seed's
``kv_token_id_vs_position_offset``): the draft slot at position ``p`` holds the KV computed
from (the target's hidden state at ``p``, token ``p + 1``), run at position ``p``:

* draft prefill (``_draft_extend_for_prefill``, EXTEND): each request's ``input_ids`` are
  shifted left by one and the token sampled after the prefill is appended; same slots and
  positions as the target's extend;
* draft extend after a verify (``_draft_extend_for_decode``, DRAFT_EXTEND_V2): fed
  ``next_token_ids`` (entry ``j`` is the token at ``c + 1 + j``) at positions ``[c, c + n)``;
* draft decode step ``i`` (``draft_forward``, DECODE, topk 1): fed the draft's own guess for
  token ``c + i + 1`` at position ``c + i`` (``c``: the batch's ``seq_lens``), written to
  ``req_to_token[row, c + i]``; it reads positions ``[0, c + i]``.

Spec v1 (``EAGLEWorker``, eager): the draft decode steps run ``bs * topk`` lanes into scratch slots sglang gives
back right after the phase; they read the committed prefix ``[0, c)`` (HEAD) and write nothing, HEAD forgetting the
scratch slots' earlier records (``adapter/draft.DraftBatchAdapter(spec_v1=True)``, ``ForwardView.unrecorded_stores``);
its draft extends follow the convention above (DRAFT_EXTEND over the kept tokens at ``[c, c + a)``).

TAIL records the token each draft forward is fed (so a draft record's TOKEN is the token at
``p + 1``) and checks the position it runs at; HEAD checks position, K/V hash and slot of every
draft slot read, **not chain links**: sglang's radix insert (``RadixCache.cache_unfinished_req``)
re-points a request's earlier positions at another request's slots holding the same tokens, and
their draft records differ where one had a chunk boundary (the thrown-away sample), so a link
written from the request's own slot breaks (docs/history/speculative.md). The request's own tokens are **not** checked in the draft pool
(no token oracle): sglang leaves draft slots whose ``p + 1`` token is not the request's own --
the last slot of a radix-cached prefix holds the KV of the cached request's next token, the last
slot of an unfinished prefill chunk the KV of the thrown-away sample -- and never rewrites them,
so a token check there would report what sglang does by design (a stale draft KV only lowers the
acceptance rate; the target verifies every token). The chunk-end case is not design but sglang bug #26329 (fixed by
#26800 in 0.5.13; 0.5.12 ships it): reversed on 0.5.23 it goes unreported here (docs/real-bugs.md,
``eagle_chunked_tail_token_pr26800``). The radix-prefix-end case is sglang's design.

Perturbations: ``SGLANG_KV_CANARY_PERTURB_TARGET_GROUP=draft`` moves every perturbation from the
target's pool to the draft's (the target then injects nothing); otherwise the draft injects
nothing.
"""

from __future__ import annotations

import dataclasses

from .config import CanaryConfig, CanaryConfigError
from .runner import CanaryManager
from .violations import STATS_PREFIX

DRAFT_GROUP = "draft"  # the draft pool's buffer group name (SGLANG_KV_CANARY_PERTURB_TARGET_GROUP=draft)
KV_TOKEN_ID_VS_POSITION_OFFSET = 1  # the draft slot at position p holds the KV of token p + 1
DRAFT_STATS_PREFIX = "kv_canary_draft_stats"
DRAFT_INSTALLED_PREFIX = "kv_canary_draft_installed"
DRAFT_NOT_VERIFIED = "the speculative draft model's KV pool is not verified"
FLAG_TARGET_GROUP = "SGLANG_KV_CANARY_PERTURB_TARGET_GROUP"

_PERTURB_PROBS = tuple(f.name for f in dataclasses.fields(CanaryConfig)
                       if f.name.startswith("perturb_") and f.name.endswith("_prob"))


def perturbs_draft(config: CanaryConfig) -> bool:
    return config.perturb_target_group == DRAFT_GROUP


def target_config(config: CanaryConfig, draft_skip_reason: str) -> CanaryConfig:
    """The target's config: without perturbations when they target the draft pool (refused when it is not verified)."""
    if not perturbs_draft(config):
        return config
    if draft_skip_reason:
        raise CanaryConfigError(
            f"{FLAG_TARGET_GROUP}={DRAFT_GROUP}: {DRAFT_NOT_VERIFIED} here ({draft_skip_reason}); "
            "target another group or unset it")
    return dataclasses.replace(config, perturb_target_group="", **{p: 0.0 for p in _PERTURB_PROBS})


def draft_config(config: CanaryConfig) -> CanaryConfig:
    """The draft pool's config: no token oracle (see the module docstring), no sweep (the radix cache's
    slots are swept in the target pool), perturbations only with ``PERTURB_TARGET_GROUP=draft``."""
    perturb = {} if perturbs_draft(config) else {p: 0.0 for p in _PERTURB_PROBS}
    return dataclasses.replace(config, token_oracle=False, sweep_interval=0, swa_divergence_stats_interval=0,
                               perturb_target_group="", **perturb)


class DraftCanaryManager(CanaryManager):
    """A ``CanaryManager`` of the draft pool: the same flow, its own stats lines (``kv_canary_draft_stats=``;
    its ready line is ``kv_canary_ready=1 ... groups=draft``)."""

    def __init__(self, *, groups, **kwargs):
        super().__init__(groups=[dataclasses.replace(g, check_chain=False) for g in groups], **kwargs)

    def note_draft_step(self, step: int) -> None:
        """The draft decode step the next forwards run, for wiring that routes the steps of a draft decode phase
        without marking the batch (the adapter's ``active_step``; 0 outside a phase)."""
        self._adapter.active_step = step

    def stats_line(self, host_counters=None) -> str:
        return DRAFT_STATS_PREFIX + super().stats_line(host_counters)[len(STATS_PREFIX):]
