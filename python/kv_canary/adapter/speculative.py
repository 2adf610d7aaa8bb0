"""sglang EAGLE (0.5.12; 0.5.23's spec v2 alike): the accepted tokens join the target's token oracle (spec v2), or are written (spec v1).

Spec v1 (``EAGLEWorker``, topk > 1 or ``--disable-overlap-schedule``): ``around_eagle_v1_verify`` below.

``EAGLEWorkerV2.verify`` runs the TARGET_VERIFY forward (the batch adapter's view:
``seq_lens + n``, ``draft_tokens_per_request = n``), then samples on its own
(``EagleVerifyInput.sample``; ``ModelRunner.sample`` is not called for verify).
Its result carries what the scheduler appends to each request:
``next_token_ids[i*n : i*n + accept_lens[i]]`` (``process_batch_result_decode``),
at positions ``seq_lens[i] + 1 ..`` (``seq_lens``: the verify batch's committed
lengths). The AFTER hook here advances the oracle to the accepted prefix, on the device
(``CanaryManager.record_accepted``: ``row_chain`` over the appended tokens, the
bonus token pending for ``next_token``; one Triton launch), before the next forward is launched.
"""

from __future__ import annotations

from typing import Optional, Tuple


def _target_manager(worker):
    """The target runner's manager (on a line whose own call sites drive it, held by their slot object)."""
    from .managers import canary_of

    runner = getattr(getattr(worker, "target_worker", None), "model_runner", None)
    return None if runner is None else canary_of(runner)


def after_eagle_v2_verify(result, worker, batch, *args, **kwargs) -> None:
    """AFTER ``EAGLEWorkerV2.verify(batch, ...)`` (0.5.23 adds ``pp_proxy_tensors``, ``grammar_barrier``): advance the target's token oracle to the accepted prefix."""
    manager = _target_manager(worker)
    if getattr(manager, "token_oracle", None) is None or not manager.init_finished or batch.forward_mode.is_idle():
        return
    accept_lens = getattr(result, "accept_lens", None)
    if accept_lens is None or result.next_token_ids is None:
        return
    manager.record_accepted(req_pool_indices=batch.req_pool_indices, committed=batch.seq_lens,
                            next_token_ids=result.next_token_ids, accept_lens=accept_lens,
                            batch_size=int(batch.req_pool_indices.shape[0]),
                            n=int(result.speculative_num_draft_tokens))


def around_eagle_v1_verify(original, worker, batch, *args, **kwargs):
    """AROUND ``EAGLEWorker.verify(batch)`` (spec v1): the tree verify's deferred TAIL over the kept drafts.

    Before: the committed lengths ``c`` (``batch.seq_lens``, which verify advances) and the tree's fed tokens and
    positions (``batch.spec_info``: ``draft_token``, ``positions``, tree order). After: sglang returns
    ``(logits, EagleVerifyOutput, can_run_cuda_graph)``; the output's ``accept_indices`` are the kept nodes
    (request-major, root first, cut after a finishing token), ``num_correct_drafts_per_req_cpu[i] + 1`` their
    count per request, ``accept_tokens`` the tokens the scheduler appended; sglang has re-laid (or, page size
    > 1 with topk > 1, moved the K/V of) the kept nodes to ``req_to_token[row, c : c + a]``.
    """
    manager = _target_manager(worker)
    if manager is None or not manager.init_finished or batch.forward_mode.is_idle():
        return original(worker, batch, *args, **kwargs)
    spec_info = batch.spec_info
    committed = batch.seq_lens.clone()
    rows = batch.req_pool_indices
    result = original(worker, batch, *args, **kwargs)
    res = result[1]
    accept_lens = [int(x) + 1 for x in res.num_correct_drafts_per_req_cpu]
    if accept_lens:
        manager.write_accepted_drafts(
            rows=rows, committed=committed, accept_lens=accept_lens, kept_nodes=res.accept_indices,
            fed_tokens=spec_info.draft_token, fed_positions=spec_info.positions, appended=res.accept_tokens)
    return result


SPEC_POOL_CLASSES = ("MHATokenToKVPool",)  # the pools speculative decoding was run end to end with (target, draft)
# a line's further target pools (``SglangLine.spec_target_pools``: 0.5.23's SWAKVPool) are verified with this algorithm
# and a draft model of its own only (test_e2e_speculative_swa: EAGLE, topk 1, a separate EAGLE draft over MHA)
SPEC_ALGORITHM_BEYOND_MHA = "EAGLE"


def spec_pool_refusal(algorithm: Optional[str], pool, *, draft: bool,
                      target_pools: Tuple[str, ...] = SPEC_POOL_CLASSES, draft_from_target: bool = False,
                      draft_skip: str = "") -> str:
    """'' where speculative decoding over ``pool`` is verified, else why not (naming ``--speculative-algorithm``).

    ``target_pools``: the line's target pool classes (``SglangLine.spec_target_pools``); one beyond
    ``SPEC_POOL_CLASSES`` (0.5.23: ``SWAKVPool``) only with ``--speculative-algorithm EAGLE`` and a draft model of
    its own (``draft_from_target``: the draft loads the target's checkpoint, an MTP draft) whose pool is verified
    too (``draft_skip``: why not, e.g. ``--disaggregation-mode``). The draft pool is verified over
    ``SPEC_POOL_CLASSES`` only.

    MTP drafts run through the same ``EAGLEWorkerV2`` as EAGLE (``--speculative-algorithm EAGLE``/``NEXTN``,
    the draft model path the target's, sglang's ``ModelConfig._config_draft_model`` renaming the architecture to
    its ``...NextN``/``...MTP`` class), with the same batches and the same token offset in the draft's pool, but
    their targets' pools are MLA (DeepSeek/GLM NextN), hybrid sliding-window (MiMo-V2, Step-3.5) or hybrid
    linear-attention (Qwen3-Next/Qwen3.5, Nemotron-H MTP): none has been run with speculative decoding, so
    none is verified (refused on the target, the draft pool skipped with its startup line on the draft).
    """
    name = type(pool).__name__
    if not algorithm or name in SPEC_POOL_CLASSES:
        return ""
    head = f"--speculative-algorithm {algorithm} with the {'draft' if draft else 'target'} model's KV pool {name}: "
    if not draft and name in target_pools:
        if algorithm == SPEC_ALGORITHM_BEYOND_MHA and not draft_from_target and not draft_skip:
            return ""
        if draft_skip:
            return head + f"a {name} target is verified with its draft pool verified too, not with {draft_skip}"
        return head + (f"a {name} target is verified with --speculative-algorithm {SPEC_ALGORITHM_BEYOND_MHA} and a "
                       "draft model of its own (--speculative-draft-model-path, its pool MHATokenToKVPool) only; "
                       "other algorithms and MTP drafts (the target's own checkpoint) are not (docs/speculative.md)")
    extra = [p for p in target_pools if p not in SPEC_POOL_CLASSES]
    return head + (f"speculative decoding is verified with {', '.join(SPEC_POOL_CLASSES)} pools only (EAGLE/EAGLE3 "
                   "drafts, MTP drafts of models with plain multi-head attention)"
                   + (f", and {', '.join(extra)} targets with --speculative-algorithm {SPEC_ALGORITHM_BEYOND_MHA} "
                      "and a draft model of their own" if extra and not draft else "")
                   + "; MLA (DeepSeek/GLM NextN), hybrid sliding-window and hybrid linear-attention (Qwen3-Next/"
                   "Qwen3.5 MTP) pools are not verified with it (docs/speculative.md)")
