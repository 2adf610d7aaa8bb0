"""sglang 0.5.12 EAGLE (spec v2, topk = 1): the accepted tokens join the target's token oracle.

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

def _target_manager(worker):
    runner = getattr(getattr(worker, "target_worker", None), "model_runner", None)
    if runner is None or getattr(runner, "is_draft_worker", False):
        return None
    return getattr(runner, "canary_manager", None)


def after_eagle_v2_verify(result, worker, batch, *args, **kwargs) -> None:
    """AFTER ``EAGLEWorkerV2.verify(batch)``: advance the target's token oracle to the accepted prefix."""
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


SPEC_POOL_CLASSES = ("MHATokenToKVPool",)  # the pools speculative decoding was run end to end with (target, draft)


def spec_pool_refusal(server_args, pool, *, draft: bool) -> str:
    """'' where speculative decoding over ``pool`` is verified, else why not (naming ``--speculative-algorithm``).

    MTP drafts run through the same ``EAGLEWorkerV2`` as EAGLE (``--speculative-algorithm EAGLE``/``NEXTN``,
    the draft model path the target's, sglang's ``ModelConfig._config_draft_model`` renaming the architecture to
    its ``...NextN``/``...MTP`` class), with the same batches and the same token offset in the draft's pool, but
    their targets' pools are MLA (DeepSeek/GLM NextN), hybrid sliding-window (MiMo-V2, Step-3.5) or hybrid
    linear-attention (Qwen3-Next/Qwen3.5, Nemotron-H MTP): none has been run with speculative decoding, so
    none is verified (refused on the target, the draft pool skipped with its startup line on the draft).
    """
    algorithm = getattr(server_args, "speculative_algorithm", None)
    name = type(pool).__name__
    if not algorithm or name in SPEC_POOL_CLASSES:
        return ""
    return (f"--speculative-algorithm {algorithm} with the {'draft' if draft else 'target'} model's KV pool {name}: "
            f"speculative decoding is verified with {', '.join(SPEC_POOL_CLASSES)} pools only (EAGLE/EAGLE3 drafts, "
            "MTP drafts of models with plain multi-head attention); MLA (DeepSeek/GLM NextN), hybrid sliding-window "
            "and hybrid linear-attention (Qwen3-Next/Qwen3.5 MTP) pools are not verified with it "
            "(docs/speculative.md)")
