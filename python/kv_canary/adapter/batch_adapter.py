"""sglang ``ForwardBatch`` -> ``ForwardView`` (device) and ``HostBatch`` (host).

Extend-like batches (EXTEND, MIXED, DRAFT_EXTEND) carry per-request extend
lengths and start offsets; decode-like batches (DECODE, TARGET_VERIFY, and
every CUDA-graph capture) have the same number of new tokens per request, whose
start/length tensors come from preallocated buffers so a captured graph reads
fixed addresses. Reading attributes only: no sglang import.

TARGET_VERIFY (speculative decoding): sglang's ``seq_lens`` is the committed
length and the ``n`` draft tokens sit at ``[seq_lens, seq_lens + n)``
(``eagle_info_v2.prepare_for_v2_verify``), so the view's ``seq_lens`` (tokens after
this forward) is ``seq_lens + n``, computed into a preallocated buffer (graph-safe),
and ``draft_tokens_per_request = n`` (``kv_canary.speculative``; ``staged``: the TAIL
stages the drafts as their own expected tokens). A CUDA-graph padding
request (``out_cache_loc`` 0) gets 0 there, so it reads and writes nothing.

With ``tree_verify`` (spec v1, ``EAGLEWorker``: a config fact fixed at install) a
TARGET_VERIFY forward feeds a tree of drafts at positions ``c + depth``: its view reads
``[0, c)`` (``seq_lens`` = the committed length, padding lanes 0, same buffer) and
writes nothing (``new_lens`` 0); the kept drafts are written after sglang's verify
(``kv_canary.speculative.build_accepted_drafts``, ``CanaryManager.write_accepted_drafts``). The forward still
stores K/V into all ``n`` slots, freed ones (rejected nodes) that may hold an earlier owner's records: HEAD forgets
those records (``ForwardView.unrecorded_stores``), so the scrub does not take the new bytes for corruption.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ..views import ForwardView, HostBatch
from .embed_overrides import fed_positions, marked_ids, override_positions, recorded_prompt

_EXTEND_MODES = ("EXTEND", "MIXED", "DRAFT_EXTEND", "DRAFT_EXTEND_V2", "SPLIT_PREFILL")
_EAGER_EXTEND_MODES = ("EXTEND", "MIXED")


class SglangBatchAdapter:
    def __init__(self, *, max_batch_size: int, device: torch.device, tree_verify: bool = False,
                 req_row: Callable[[object], int] = lambda req: req.req_pool_idx):
        self._max_bs = max_batch_size
        # (tokens, flat override positions) of the extend forward extend_requests() last saw, for its view(); None
        # without overrides (adapter/embed_overrides)
        self._override_marks: Optional[Tuple[int, Sequence[int]]] = None
        self._req_row = req_row  # the scheduler Req's req_to_token row (the line's reader: adapter/lines)
        self._tree_verify = tree_verify  # spec v1: a verify's TAIL is deferred to acceptance
        self._device = device
        self._uniform: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._uniform_buffers(1)
        if tree_verify:
            self._uniform_buffers(0)  # a tree verify's TAIL: no new token per request
        # TARGET_VERIFY: seq_lens + n (the view's "tokens after this forward"), written per forward
        self._verify_seq_lens = torch.zeros(max_batch_size, dtype=torch.int64, device=device)

    def _uniform_buffers(self, tokens_per_req: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(starts, lens): int64[max_bs] = (i * n, n); allocated once per n."""
        bufs = self._uniform.get(tokens_per_req)
        if bufs is None:
            idx = torch.arange(self._max_bs, dtype=torch.int64, device=self._device)
            bufs = (idx * tokens_per_req, torch.full_like(idx, tokens_per_req))
            self._uniform[tokens_per_req] = bufs
        return bufs

    @staticmethod
    def _is_target_verify(fb) -> bool:
        return fb.forward_mode.name == "TARGET_VERIFY"

    @staticmethod
    def _is_extend(fb) -> bool:
        return fb.forward_mode.name in _EXTEND_MODES and fb.extend_seq_lens is not None

    def batch_size(self, fb) -> int:
        if fb.forward_mode.is_idle():
            return 0
        return int(fb.batch_size)

    @staticmethod
    def _tokens_per_request(fb, bs: int) -> int:
        """Decode-like batches (DECODE, TARGET_VERIFY, graph capture): the same count for every request."""
        return int(fb.input_ids.shape[0]) // bs if bs else 1

    def _deferred(self, fb) -> bool:
        """A spec v1 tree verify: its TAIL writes nothing (deferred to acceptance)."""
        return self._tree_verify and self._is_target_verify(fb)

    def num_tokens(self, fb) -> int:
        """Real (unpadded) new tokens of the batch: the slots its TAIL must write per group."""
        return 0 if fb.forward_mode.is_idle() or self._deferred(fb) else int(fb.input_ids.shape[0])

    def written_slots(self, fb) -> Sequence[int]:
        """Host copy of out_cache_loc (syncs; perturbation only)."""
        if fb.forward_mode.is_idle() or self._deferred(fb):
            return []
        return [int(x) for x in fb.out_cache_loc.tolist()]

    def rids(self, fb) -> Optional[Sequence[str]]:
        return getattr(fb, "rids", None)

    def view(self, fb) -> ForwardView:
        bs = self.batch_size(fb)
        extend = self._is_extend(fb)
        if extend:
            starts, lens = fb.extend_start_loc, fb.extend_seq_lens
            if lens.dtype != torch.int32 or starts.dtype != torch.int32:
                # one index dtype per batch kind, as precompiled at install (no JIT while serving); eager
                # extend forwards only (never captured), so the two small casts allocate off any graph
                starts, lens = starts.to(torch.int32), lens.to(torch.int32)
            lens_cpu = fb.extend_seq_lens_cpu
            max_new = max(lens_cpu) if lens_cpu else int(fb.input_ids.shape[0])
        else:
            n = self._tokens_per_request(fb, bs)
            starts, lens = self._uniform_buffers(n)
            starts, lens = starts[:bs], lens[:bs]
            max_new = n
        seq_lens, drafts = fb.seq_lens, 0
        tree_verify = self._deferred(fb) and bs > 0
        if tree_verify:  # spec v1: read [0, c), write nothing (padding lanes read nothing either)
            n = max_new
            starts, lens = self._uniform_buffers(0)
            starts, lens, max_new = starts[:bs], lens[:bs], 0
            seq_lens = self._verify_seq_lens[:bs]
            real = fb.out_cache_loc[: bs * n: n] > 0
            torch.mul(fb.seq_lens[:bs].to(torch.int64), real, out=seq_lens)
        elif self._is_target_verify(fb) and bs:
            drafts = max_new
            seq_lens = self._verify_seq_lens[:bs]
            # A CUDA-graph padding request (out_cache_loc 0, seq_len = the fill value) gets 0: it reads
            # and writes nothing (committed + n would make HEAD read row 0's first slots).
            real = fb.out_cache_loc[: bs * drafts : drafts] > 0
            torch.mul(fb.seq_lens[:bs].to(torch.int64) + drafts, real, out=seq_lens)
        input_ids = fb.input_ids
        marks = self._override_marks  # a prefill's embedding overrides, recorded under a marker token
        if marks is not None and extend and self.eager_extend(fb) and marks[0] == int(input_ids.shape[0]):
            input_ids = marked_ids(input_ids, marks[1])
        return ForwardView(
            input_ids=input_ids,
            positions=fb.positions,
            out_cache_loc=fb.out_cache_loc,
            req_pool_indices=fb.req_pool_indices,
            seq_lens=seq_lens,
            new_starts=starts,
            new_lens=lens,
            batch_size=bs,
            max_new_len=max_new,
            draft_tokens_per_request=drafts,
            # the token oracle staged what an extend batch feeds (extend_requests), a verify its drafts (TAIL)
            staged=extend or drafts > 0,
            # a tree verify stores every node, records none (the kept ones: the deferred TAIL; the rest are freed)
            unrecorded_stores=tree_verify,
        )

    @staticmethod
    def eager_extend(fb) -> bool:
        """A prefill of the target model: its HEAD/TAIL never run inside a replayed CUDA graph (0.5.12's piecewise
        graphs are refused; 0.5.23's breakable prefill graphs replay only the transformer body, inside the outer
        forward whose HEAD/TAIL run eagerly; an EAGLE draft extend, which its graph runner may replay, is not
        one)."""
        return fb.forward_mode.name in _EAGER_EXTEND_MODES

    def extend_requests(self, fb):
        """(row, admission key, prefix length, new tokens, record) per request of an extend batch, batch
        order; [] otherwise.

        ``record()`` returns the scheduler's own record of the request: (prompt ids,
        output ids so far). The admission key changes when the row gets another request, or
        the same request again after a retraction (its cached prefix is matched anew).
        Needs the scheduler's Req objects, attached as ``fb.kv_canary_reqs`` by the
        plugin's ``ForwardBatch.init_new`` hook.
        """
        reqs = getattr(fb, "kv_canary_reqs", None)
        self._override_marks = None
        if reqs is None or not self._is_extend(fb):
            return []
        prefix, new = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        if prefix is None or new is None or len(prefix) != len(reqs) or len(new) != len(reqs):
            raise ValueError(
                f"kv-canary: an extend batch of {len(reqs)} requests has extend_prefix_lens_cpu="
                f"{None if prefix is None else len(prefix)} / extend_seq_lens_cpu={None if new is None else len(new)} "
                "entries; the token oracle needs one per request")
        if self.eager_extend(fb) and any(override_positions(r) for r in reqs):
            # read by this forward's view(), whose forward batch may be another object without the Req list
            self._override_marks = (sum(int(n) for n in new), fed_positions(reqs, prefix, new))
        return [(int(self._req_row(req)), (str(req.rid), getattr(req, "retraction_count", 0), id(req)), int(p), int(n),
                 lambda r=req: (recorded_prompt(r), r.output_ids))
                for req, p, n in zip(reqs, prefix, new)]

    def host_batch(self, fb) -> Optional[HostBatch]:
        """Host copy of the layout; syncs the device (perturbation and debugging only)."""
        bs = self.batch_size(fb)
        if bs == 0:
            return None
        rows = [int(x) for x in fb.req_pool_indices[:bs].tolist()]
        seq = fb.seq_lens_cpu if getattr(fb, "seq_lens_cpu", None) is not None else fb.seq_lens
        seq_lens = [int(x) for x in seq[:bs].tolist()]
        if self._is_extend(fb) and fb.extend_seq_lens_cpu is not None:
            new_lens = [int(x) for x in fb.extend_seq_lens_cpu]
        else:
            new_lens = [self._tokens_per_request(fb, bs)] * bs
        if self._deferred(fb):
            new_lens = [0] * bs
        elif self._is_target_verify(fb):
            seq_lens = [s + n for s, n in zip(seq_lens, new_lens)]
        rids = list(self.rids(fb) or ["?"] * bs)
        return HostBatch(rows=rows, seq_lens=seq_lens, new_lens=new_lens, rids=rids)
