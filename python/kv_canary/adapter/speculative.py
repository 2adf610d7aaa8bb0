"""sglang 0.5.12 EAGLE (spec v2, topk = 1): the accepted tokens join the target's token oracle.

``EAGLEWorkerV2.verify`` runs the TARGET_VERIFY forward (the batch adapter's view:
``seq_lens + n``, ``draft_tokens_per_request = n``), then samples on its own
(``EagleVerifyInput.sample``; ``ModelRunner.sample`` is not called for verify).
Its result carries what the scheduler appends to each request:
``next_token_ids[i*n : i*n + accept_lens[i]]`` (``process_batch_result_decode``),
at positions ``seq_lens[i] + 1 ..`` (``seq_lens``: the verify batch's committed
lengths). The AFTER hook here advances the oracle to the accepted prefix, on the device
(``kv_canary.speculative.record_accepted``: ``row_chain`` over the appended tokens, the
bonus token pending for ``next_token``), before the next forward is launched.
"""

from __future__ import annotations

from ..speculative import record_accepted


def _target_manager(worker):
    runner = getattr(getattr(worker, "target_worker", None), "model_runner", None)
    if runner is None or getattr(runner, "is_draft_worker", False):
        return None
    return getattr(runner, "canary_manager", None)


def after_eagle_v2_verify(result, worker, batch, *args, **kwargs) -> None:
    """AFTER ``EAGLEWorkerV2.verify(batch)``: advance the target's token oracle to the accepted prefix."""
    manager = _target_manager(worker)
    oracle = getattr(manager, "token_oracle", None)
    if oracle is None or not manager.init_finished or batch.forward_mode.is_idle():
        return
    accept_lens = getattr(result, "accept_lens", None)
    if accept_lens is None or result.next_token_ids is None:
        return
    bs = int(batch.req_pool_indices.shape[0])
    record_accepted(staged=oracle.staged, row_chain=oracle.row_chain, sampled=oracle.sampled,
                    req_pool_indices=batch.req_pool_indices, committed=batch.seq_lens,
                    next_token_ids=result.next_token_ids, accept_lens=accept_lens, batch_size=bs,
                    n=int(result.speculative_num_draft_tokens))
