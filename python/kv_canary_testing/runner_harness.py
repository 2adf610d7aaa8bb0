"""A ``CanaryManager`` on real sglang ``ForwardBatch`` objects and a tiny attention "model", for the runner's unit tests.

The kernels are the real torch reference wrapped by spies that record the call order; the model writes K/V at
``out_cache_loc`` the way attention does. Needs sglang (``ForwardBatch``): import it after
``pytest.importorskip("sglang.srt.model_executor.forward_batch_info")``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from kv_canary.adapter.batch_adapter import SglangBatchAdapter
from kv_canary.api import _patch_model_forward
from kv_canary.buffer_groups import PoolLayout, build_group
from kv_canary.config import CanaryConfig, CanaryMode
from kv_canary.kernels import CanaryKernels
from kv_canary.kernels import reference as ref
from kv_canary.runner import CanaryManager
from kv_canary.speculative import build_accepted_drafts, record_accepted
from kv_canary.views import LaunchCapacities

SLOTS, CTX = 256, 64


class TinyAttentionModel(torch.nn.Module):
    def __init__(self, k, v, events):
        super().__init__()
        self.k, self.v, self.events = k, v, events
        self.nested = False
        self.drop_lane = None  # a lane whose K/V store goes to the padding slot 0 (a dropped write)
        self.logits_processor = None  # a LogitsStage when the harness anchors the TAIL there
        self.skip_logits = False  # a forward path that never reaches the last stage
        self.raise_before_logits = False  # a forward that raises after its K/V stores, before the last stage

    def forward(self, input_ids, positions, forward_batch):
        self.events.append("forward")
        loc = forward_batch.out_cache_loc.clone()
        if self.drop_lane is not None:
            loc[self.drop_lane] = 0
        self.k[loc] = input_ids.float()[:, None, None] + positions.float()[:, None, None] / 100
        self.v[loc] = -self.k[loc]
        if self.nested:
            self.nested = False
            self.forward(input_ids, positions, forward_batch)  # a re-entrant call: no second bracket
        if self.raise_before_logits:
            raise RuntimeError("the model raised before the logits")
        if self.logits_processor is not None and not self.skip_logits:
            self.logits_processor(input_ids)
        return input_ids


class LogitsStage(torch.nn.Module):
    """The model's last stage after every K/V store (sglang's logits processor); the early TAIL's anchor."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def forward(self, input_ids):
        self.events.append("logits")
        return input_ids


class Harness:
    def __init__(self, mode=CanaryMode.RAISE, delay=0, anchor=False, **config_fields):
        self.events = []
        self.k = torch.zeros(SLOTS, 1, 4)
        self.v = torch.zeros(SLOTS, 1, 4)
        config = CanaryConfig(**{"mode": mode, "d2h_delay_steps": delay, "stats_print_every_n_steps": 0,
                                 **config_fields})
        group = build_group(PoolLayout("full", [self.k], [self.v]), config, torch.device("cpu"))
        self.r2t = torch.zeros(8, CTX, dtype=torch.int32)

        def spy(name, fn):
            def wrapped(*a, **kw):
                self.events.append(name)
                return fn(*a, **kw)

            return wrapped

        kernels = CanaryKernels("spy", spy("verify", ref.launch_verify), spy("write", ref.launch_write),
                                spy("scrub", ref.launch_scrub), spy("sweep", ref.launch_index_sweep), record_accepted,
                                build_accepted_drafts, spy("stamp", ref.launch_witness_stamp),
                                spy("check", ref.launch_witness_check), ref.launch_first_read, graph_safe=False)
        self.manager = CanaryManager(
            config=config, groups=[group], kernels=kernels, req_to_token=self.r2t,
            capacities=LaunchCapacities(max_batch_size=9, max_context_len=CTX, verify_programs_target=1),
            batch_adapter=SglangBatchAdapter(max_batch_size=9, device=torch.device("cpu")),
            device=torch.device("cpu"),
        )
        self.model = TinyAttentionModel(self.k, self.v, self.events)
        if anchor:
            self.model.logits_processor = LogitsStage(self.events)
        _patch_model_forward(self.model, self.manager, self.model.logits_processor)
        self.next_slot = 1
        self.lens = {}
        self.own = {}  # row -> the request's tokens so far (the scheduler's record)
        self.reqs = {}  # row -> its Req stand-in

    def batch(self, rows_tokens, decode=False):
        """rows_tokens: {row: [new token ids]} -> a real ForwardBatch (EXTEND or DECODE).

        The new tokens are the requests' own: an extend batch carries the scheduler's Req
        records (the token oracle's admission), a decode batch's tokens were "sampled"
        after the previous forward (same rows, same order) and reach the oracle as sglang's
        ``ModelRunner.sample`` hook passes them.
        """
        if decode:
            self.manager.record_sampled(torch.tensor([t for toks in rows_tokens.values() for t in toks]))
        ids, locs, pos, rows, seqs, ext, pre = [], [], [], [], [], [], []
        for row, toks in rows_tokens.items():
            start = self.lens.get(row, 0)
            slots = list(range(self.next_slot, self.next_slot + len(toks)))
            self.next_slot += len(toks)
            self.r2t[row, start : start + len(toks)] = torch.tensor(slots, dtype=torch.int32)
            ids += toks
            locs += slots
            pos += list(range(start, start + len(toks)))
            rows.append(row)
            seqs.append(start + len(toks))
            ext.append(len(toks))
            pre.append(start)
            self.lens[row] = start + len(toks)
            self.own[row] = self.own.get(row, []) + list(toks)
        kw = {}
        if not decode:
            i32 = dict(dtype=torch.int32)  # as sglang's ForwardBatch.init_new builds them
            kw = dict(
                extend_seq_lens=torch.tensor(ext, **i32), extend_prefix_lens=torch.tensor(pre, **i32),
                extend_start_loc=torch.tensor([sum(ext[:i]) for i in range(len(ext))], **i32),
                extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=pre, extend_num_tokens=sum(ext),
            )
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(rows), input_ids=torch.tensor(ids), req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor(seqs), out_cache_loc=torch.tensor(locs), seq_lens_sum=sum(seqs),
            seq_lens_cpu=torch.tensor(seqs), positions=torch.tensor(pos), rids=[f"r{r}" for r in rows], **kw,
        )
        for r in rows:  # the scheduler's Req objects: one per request, kept across its forwards
            req = self.reqs.setdefault(r, SimpleNamespace(req_pool_idx=r, rid=f"r{r}", retraction_count=0))
            req.origin_input_ids, req.output_ids = list(self.own[r]), []
        fb.kv_canary_reqs = [self.reqs[r] for r in rows]
        return fb

    def step(self, fb):
        """What the ModelRunner.forward hook does."""
        m = self.manager
        with m.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
            with m.with_active_single_forward_manager(0):
                return self.model(fb.input_ids, fb.positions, fb)
