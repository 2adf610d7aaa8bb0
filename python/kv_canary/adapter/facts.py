"""Read sglang once: what the canary's install needs from one model runner, as one frozen record.

``read_facts(server_args, model_runner, mode)`` is the only place the install reads sglang's
server args and model runner; ``api.install_canary`` and everything it builds (capacities,
batch adapter, deferred writes, precompile, memory line) take the record. The live objects
it holds (the model, the KV pool, the request table) are the ones the canary works on; every
other field is a plain value. Speculative decoding's mode is read into ``SpecFacts`` once
(also for the memory sizing that runs before the pool exists: ``SpecFacts.read``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..buffer_groups import PoolContext
from ..memory import DEFAULT_MAX_PREFILL_TOKENS

EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")  # served by EAGLEWorker (spec v1) / EAGLEWorkerV2 (spec v2)


@dataclass(frozen=True)
class SpecFacts:
    """``--speculative-algorithm`` as the canary verifies it.

    ``tree_verify``: sglang runs EAGLE through spec v1 (the line's ``spec_v1``: 0.5.12's ``EAGLEWorker`` with the
    overlap scheduler off): a verify's TAIL is deferred to the drafts sglang keeps. ``draft_skip``: '' when the draft model's own pool is verified,
    else why not (naming the flag).
    """

    algorithm: str
    tree_verify: bool
    num_steps: int
    draft_tokens_per_request: int
    draft_skip: str
    draft_from_target: bool = False  # the draft loads the target's checkpoint (an MTP draft), or no draft path
    # on the draft runner: the target's KV pool class, behind the token allocator the draft shares with the target
    # (a target pool beyond SPEC_POOL_CLASSES is verified with its draft pool verified only); '' on the target runner
    target_pool_name: str = ""

    @classmethod
    def read(cls, server_args: Any, mode: str, model_runner: Any = None) -> Optional["SpecFacts"]:
        algorithm = getattr(server_args, "speculative_algorithm", None)
        if not algorithm:
            return None
        from .draft import draft_skip_reason
        from .lines import current_line

        return cls(
            algorithm=str(algorithm),
            tree_verify=algorithm in EAGLE_ALGORITHMS and current_line().spec_v1(server_args),
            num_steps=int(getattr(server_args, "speculative_num_steps", 1) or 1),
            draft_tokens_per_request=int(getattr(server_args, "speculative_num_draft_tokens", 1) or 1),
            draft_skip=draft_skip_reason(server_args, mode),
            draft_from_target=_same_path(getattr(server_args, "speculative_draft_model_path", None),
                                         getattr(server_args, "model_path", None)),
            target_pool_name=_shared_allocator_pool(model_runner),
        )


def _shared_allocator_pool(model_runner: Any) -> str:
    """On an EAGLE draft runner, the class of the pool behind its token allocator: the target's (sglang hands the
    draft runner the target's allocator, so draft and target slots are the same indices); '' elsewhere."""
    if not getattr(model_runner, "is_draft_worker", False):
        return ""
    get_kvcache = getattr(getattr(model_runner, "token_to_kv_pool_allocator", None), "get_kvcache", None)
    return type(get_kvcache()).__name__ if callable(get_kvcache) else ""


def _same_path(draft: Any, target: Any) -> bool:
    """No draft model path, or the target's (MTP drafts load the target's checkpoint)."""
    import os

    if not draft:
        return True
    return bool(target) and os.path.realpath(str(draft)) == os.path.realpath(str(target))


@dataclass(frozen=True)
class SglangFacts:
    """One model runner (target or EAGLE draft), read at install.

    req_to_token: int32[request rows, context + a few] (the live request table);
    pool: the live KV pool (its buffers are viewed zero-copy); model: its ``forward`` is bracketed.
    """

    line: str
    device: torch.device
    tp_rank: int
    is_draft_worker: bool
    model: Any
    pool: Any
    pool_name: str
    pool_context: PoolContext
    req_to_token: torch.Tensor
    req_pool_size: int
    cuda_graph_max_bs: int
    max_prefill_tokens: int  # sglang's prefill token budget per forward (and the chunk size, when larger)
    cuda_graphs: bool
    pd_mode: Optional[str]
    spec: Optional[SpecFacts]
    mrope: bool
    reserved_bytes: Optional[int]  # held back before sglang sized the KV pool (None: no reservation hook ran)
    # the module whose start follows every K/V store of a forward (sglang's models: ``logits_processor``, after the
    # last layer); the TAIL runs there, beside the LM head (runner/early_tail.py). None: after the forward
    tail_anchor: Optional[torch.nn.Module]

    @property
    def tree_verify(self) -> bool:
        return self.spec is not None and self.spec.tree_verify


def max_prefill_tokens(server_args: Any) -> int:
    budget = int(getattr(server_args, "max_prefill_tokens", 0) or DEFAULT_MAX_PREFILL_TOKENS)
    chunk = int(getattr(server_args, "chunked_prefill_size", 0) or 0)
    return max(budget, chunk)


def read_facts(server_args: Any, model_runner: Any, mode: str) -> SglangFacts:
    from .disagg import disaggregation_mode
    from .lines import current_line
    from .pools import pool_context

    pool = model_runner.token_to_kv_pool
    req_pool = model_runner.req_to_token_pool
    return SglangFacts(
        line=current_line().name,
        device=torch.device(model_runner.device),
        tp_rank=current_line().tp_rank(model_runner),
        is_draft_worker=bool(getattr(model_runner, "is_draft_worker", False)),
        model=model_runner.model,
        pool=pool,
        pool_name=type(pool).__name__,
        pool_context=pool_context(model_runner),
        req_to_token=req_pool.req_to_token,
        req_pool_size=int(req_pool.size),
        cuda_graph_max_bs=int(getattr(server_args, "cuda_graph_max_bs", 0) or 0),
        max_prefill_tokens=max_prefill_tokens(server_args),
        cuda_graphs=not bool(getattr(server_args, "disable_cuda_graph", False)),
        pd_mode=disaggregation_mode(server_args),
        spec=SpecFacts.read(server_args, mode, model_runner),
        mrope=bool(getattr(model_runner, "model_is_mrope", False)),
        reserved_bytes=getattr(model_runner, "kv_canary_reserved_bytes", None),
        tail_anchor=tail_anchor(model_runner.model),
    )


def tail_anchor(model: Any) -> Optional[torch.nn.Module]:
    """sglang's causal LMs end ``forward`` with ``self.logits_processor(input_ids, hidden_states, self.lm_head,
    forward_batch)``, after every layer (and so every K/V store); the canary's TAIL can start there."""
    anchor = getattr(model, "logits_processor", None)
    return anchor if isinstance(anchor, torch.nn.Module) else None
