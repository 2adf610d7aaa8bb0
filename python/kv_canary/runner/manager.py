"""``CanaryManager``: the canary's outer step, and the one place the per-forward flow reads top-down.

Per outer step (one ``ModelRunner.forward``, or one EAGLE draft phase of several
inner forwards), the engine wiring does::

    with manager.with_ops_outside_graph(single_forward_indices=[0], maybe_inaccurate_forward_batch=fb):
        with manager.with_active_single_forward_manager(0):
            model.forward(...)        # patched; eager or replayed from a CUDA graph

and the patched ``model.forward`` (``adapter/forward_patch._with_canary_bracketing``) does::

    view = manager.pre_ops_maybe_inside_graph(fb, verify_later=anchored)  # plan + HEAD
    out = original_forward(...)                       # attention reads / writes KV
    manager.post_ops_maybe_inside_graph(view)         # TAIL write

So a forward is: outside pre-ops (bracket checks, token-oracle admissions,
perturbation) -> plan -> HEAD (verify every read slot; the scrub's window; stamp
the slots to fill) -> forward -> TAIL (fingerprint the new slots; check the
positions and tokens the model was fed) -> outside post-ops (the token oracle
remembers the new admissions' fed prompts' chains for their next turns, count the
forward, queue the async counter copy, read copies a few forwards old, log/raise
violations, stats). Where the model's last stage is known (sglang's logits
processor: ``anchored``), the TAIL runs from a pre-hook there, on a side stream
beside the LM head, and HEAD's verify moves in front of it (the forward writes
none of the slots it reads): HEAD keeps only the stamp on the critical path
(``runner/early_tail.py``). Everything
between the outside pre- and post-ops may be captured in a CUDA graph; the
outside ops never are. After the engine samples, ``record_sampled`` copies the
sampled ids into the token oracle (one device copy; the next forward's HEAD lands
them where its TAIL expects what each request is fed).

Speculative tree verifies (spec v1) defer their TAIL to ``write_accepted_drafts``
(deferred_writes.py). PD transfer arrivals: arrivals.py. Violation reporting, the
health check and stats: reporting.py.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, List, Optional, Protocol, Sequence

import torch

from .. import fingerprint as fp
from ..config import CanaryConfig, CanaryMode
from ..d2h import DelayedDeviceHostHandler
from ..kernels import CanaryKernels
from ..swa_divergence import SwaDivergenceLog
from ..perturb import PerturbManager
from ..token_oracle import FedRequest, TokenOracle
from ..views import ForwardView, HostBatch, LaunchCapacities
from ..buffer_groups import CanaryBufferGroup
from ..cache_index import CachedSlotIndex
from ..violations import READY_PREFIX, format_line
from .arrivals import Arrivals
from .brackets import ActiveBracket, CanaryBracketError, OutsideBracket
from .deferred_writes import DeferredWrites
from .host_copies import HostCopies
from .precompile import precompile
from .reporting import RID_HISTORY, Reporting
from .single_forward import SingleForwardManager

logger = logging.getLogger("kv_canary")

# An eager outer step (an extend, on CUDA) leaves its host bookkeeping (``_catch_up``) to the next graph replay
# (a decode step: its host work hides behind its graph), to the eager step after this many in a row, or to idle.
# An extend's launch is a batch boundary's critical path (H200: the outer exit ~0.43 ms of it, mostly the oracle's
# remembered chains; docs/history/hicache.md 7.18); violations surface at most this many forwards later.
EAGER_STEPS_WAITING = 4


class BatchAdapter(Protocol):
    """Translates the engine's batch object (sglang's ForwardBatch) to plain views."""

    def view(self, forward_batch: object) -> ForwardView: ...

    def batch_size(self, forward_batch: object) -> int: ...

    def rids(self, forward_batch: object) -> Optional[Sequence[str]]: ...

    def num_tokens(self, forward_batch: object) -> int: ...

    def written_slots(self, forward_batch: object) -> Sequence[int]: ...

    def eager_extend(self, forward_batch: object) -> bool:
        """An extend the engine always runs eagerly (never replays from a CUDA graph): its TAIL's host code runs."""
        ...

    def extend_requests(self, forward_batch: object) -> Sequence[FedRequest]:
        """(row, admission key, prefix length, new tokens, record()) of each request of an extend batch, batch
        order; record() is the scheduler's (prompt ids, output ids so far). [] for other batches."""
        ...

    def host_batch(self, forward_batch: object) -> Optional[HostBatch]: ...


class CanaryManager(Arrivals, DeferredWrites, HostCopies, Reporting):
    """The canary's outer step: brackets each forward, counts it, polls the device's counter copies.

    Device state: ``counters`` int64[NUM_COUNTERS] and ``ring`` int64[ring_capacity, RING_WIDTH] (violation rows),
    shared with every ``SingleForwardManager``; ``req_to_token`` is the engine's int[rows, max_context_len] table.
    Mixins: ``Arrivals`` (PD transfer), ``DeferredWrites`` (speculative verifies), ``HostCopies`` (HiCache's
    backups, load-backs and storage pages), ``Reporting`` (violations, health check, stats).
    """

    def __init__(
        self,
        *,
        config: CanaryConfig,
        groups: Sequence[CanaryBufferGroup],
        kernels: CanaryKernels,
        req_to_token: torch.Tensor,
        capacities: LaunchCapacities,
        batch_adapter: BatchAdapter,
        device: torch.device,
        num_single_forward_managers: int = 1,
        variant_tracker=None,
    ):
        if config.mode is CanaryMode.NONE:
            raise ValueError("CanaryManager needs --kv-canary log or raise")
        self.config = config
        self.groups = list(groups)
        self.kernels = kernels
        self.capacities = capacities
        self._adapter = batch_adapter
        self._req_to_token = req_to_token
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=device)
        self.ring = torch.zeros((config.ring_capacity, fp.RING_WIDTH), dtype=torch.int64, device=device)
        # Each request's own tokens, from the scheduler's record (never from input_ids): TAIL checks the
        # tokens it is fed against it, HEAD the chain of the tokens it reads. O(rows + tokens of one forward).
        self.token_oracle = (
            TokenOracle(rows=req_to_token.shape[0], max_batch_size=capacities.max_batch_size,
                        max_tokens_per_forward=capacities.tokens_per_forward, device=device,
                        verify_reads=config.verify_tokens, check_fed=config.write_input_assert)
            if config.uses_token_oracle else None
        )
        self._sample_sink: Optional[Callable[[torch.Tensor], None]] = None  # the oracle's, once init finished
        self.single_forward_managers = [
            SingleForwardManager(
                index=i, groups=self.groups, kernels=kernels, req_to_token=req_to_token,
                counters=self.counters, ring=self.ring, capacities=capacities, on_tail=self._on_eager_tail,
                token_oracle=self.token_oracle, scrub_slots_per_forward=config.scrub_slots_per_forward,
                check_fed=config.write_input_assert, write_witness=config.write_witness,
            )
            for i in range(num_single_forward_managers)
        ]
        self.perturb = PerturbManager(config=config, groups=self.groups, req_to_token=req_to_token)
        self._d2h = DelayedDeviceHostHandler(self.counters, config.d2h_delay_steps, config.d2h_interval)
        self.init_finished = False
        self._capturing = 0
        self._active: List[int] = []  # stack of active single-forward-manager indices
        self._in_outside_bracket = False
        self._eager_tails = 0  # TAIL launches run eagerly inside the current outside bracket
        self._prefix_cache = None  # RadixCacheView once the scheduler attaches it
        # the slots the prefix cache holds (sweep on only); filled once the scheduler attaches its cache
        self.cache_index = CachedSlotIndex(self.groups[0].num_slots, device) if config.sweep_interval > 0 else None
        self.variant_tracker = variant_tracker  # kernels.variants.VariantTracker (Triton backend) or None
        self.early_tail = None  # runner.early_tail.EarlyTail: the TAIL at the model's last stage (_patch_model_forward)
        self.eager_steps_waiting = EAGER_STEPS_WAITING if device.type == "cuda" else 0  # 0: none wait (no replays)
        self._init_arrivals()
        self._init_deferred_writes()
        self._init_host_copies()
        self._init_reporting()
        self._reset_host_state()

    def _reset_host_state(self) -> None:
        """Host-side accounting that restarts when init finishes (it mirrors the zeroed device counters)."""
        self.forwards = 0  # forwards counted on the host (mirrors counters[C_FORWARD_INDEX])
        self._wait_steps = 0  # eager outer steps in a row whose bookkeeping waits (``EAGER_STEPS_WAITING``)
        self.outer_steps = 0
        self.outside_host_ns = 0  # host time of the outside pre- and post-ops (brackets.OutsideBracket)
        self.graph_forwards = 0  # forwards whose HEAD/TAIL ran inside a replayed CUDA graph
        self._settled_forward = 0  # the forward of the last idle drain's settled stats line
        self._reset_reporting()
        self._reset_deferred_writes()
        self._swept_at = 0
        self.sweeps = 0
        self._reset_arrivals()
        if self.early_tail is not None:
            self.early_tail.early_tails = 0

    # ------------------------------------------------------------------ engine wiring and install

    def with_ops_outside_graph(
        self, *, single_forward_indices: Sequence[int], maybe_inaccurate_forward_batch: object
    ) -> OutsideBracket:
        """Host work around one outer step; never captured into a CUDA graph (a context manager).

        Entering runs ``_pre_ops_outside_graph``; a clean exit runs ``_post_ops_outside_graph``.
        """
        return OutsideBracket(self, single_forward_indices, maybe_inaccurate_forward_batch)

    def with_active_single_forward_manager(self, index: int) -> ActiveBracket:
        """Route the patched model.forward calls in this block to single-forward manager ``index``."""
        self._check_index(index)
        return ActiveBracket(self._active, index)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.single_forward_managers):
            raise CanaryBracketError(
                f"kv-canary: single-forward manager index {index} out of range "
                f"(0..{len(self.single_forward_managers) - 1})"
            )

    @property
    def is_capturing(self) -> bool:
        """Inside ``capturing()`` (CUDA-graph warmup or capture): the engine wiring must not run outside ops."""
        return self._capturing > 0

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """CUDA-graph warmup + capture: kernels are recorded, but nothing is reported or counted.

        A recapture after init (sglang recaptures when the hidden-state capture mode
        changes, or after a weight update) runs warmup forwards whose HEAD/TAIL bump the
        device counters; they are restored afterwards (stream-ordered, no host sync) so
        the health check does not see forwards the host never counted.
        """
        saved = self.counters.clone() if self._capturing == 0 and self.init_finished else None
        self._capturing += 1
        self.counters[fp.C_REPORT_ENABLED] = 0
        try:
            yield
        finally:
            self._capturing -= 1
            if saved is not None:
                self.counters.copy_(saved)
            if self._capturing == 0:
                self.counters[fp.C_REPORT_ENABLED] = 1 if self.init_finished else 0

    def mark_init_finished(self) -> None:
        """Warmup and graph capture are over: forget their synthetic data and start reporting."""
        if self.counters.device.type == "cuda":
            torch.cuda.synchronize(self.counters.device)
        self.counters.zero_()
        self.ring.zero_()
        self.counters[fp.C_REPORT_ENABLED] = 1
        self._d2h.drain()
        self._d2h.restart_steps()
        if self.token_oracle is not None:
            self.token_oracle.reset()
            self._sample_sink = self.token_oracle.record_sampled
        self._reset_host_state()
        self.init_finished = True
        if self.variant_tracker is not None:
            self.variant_tracker.seal()  # precompile and graph capture are over: a new variant now is a JIT
        logger.info(format_line(READY_PREFIX, 1, {"mode": self.config.mode.value,
                                                  "groups": ",".join(g.name for g in self.groups),
                                                  "kernels": self.kernels.name}))

    def attach_prefix_cache(self, prefix_cache) -> None:
        """The engine's prefix cache (a ``RadixCacheView``): swept, and the unused-cache perturbation's target."""
        self._prefix_cache = prefix_cache
        self.perturb.attach_prefix_cache(prefix_cache)
        if self.cache_index is not None:
            prefix_cache.attach_index(self.cache_index)

    def precompile(self, block_lengths: Sequence[int], batch_sizes: Sequence[int], verify_staged: bool = False) -> None:
        """Launch every kernel variant once at install so Triton compiles none while serving (``precompile.py``)."""
        precompile(self, block_lengths, batch_sizes, verify_staged)

    # ------------------------------------------------------------------ one forward, top-down
    # outside pre-ops -> plan + HEAD -> forward -> TAIL -> outside post-ops (count; poll the counter copies)

    def _pre_ops_outside_graph(self, fb: object) -> None:
        if not self.init_finished:
            return
        self.bound_host_batch()  # HiCache: what is batched stays bounded
        if self.token_oracle is not None:
            # Extend forwards: a newly admitted request's expected chain over its cached prefix (HEAD's verify reads
            # it); the scheduler's record of the tokens each request is fed (one non-blocking copy; the TAIL's write
            # reads them): at the TAIL when the forward runs eagerly, past the model's layer launches; the
            # admissions too where the verify runs there (an anchor). The verify stages any left right before it.
            eager = self._adapter.eager_extend(fb)
            self.token_oracle.stage(self._adapter.extend_requests(fb), fed_later=eager,
                                    admit_later=eager and self.early_tail is not None)
        if self._arrivals:  # after arrival, before the first forward that reads them
            self._perturb_arrivals()
        if self.perturb.active:
            self.perturb.perturb_pre_forward(
                forward_index=self.forwards, host_batch=lambda: self._adapter.host_batch(fb),
                view=lambda: self._adapter.view(fb),
            )

    def pre_ops_maybe_inside_graph(self, forward_batch: object, *, verify_later: bool = False) -> Optional[ForwardView]:
        """Plan + HEAD for the forward about to run (``verify_later``: its verify runs with its TAIL at the model's
        last stage, ``SingleForwardManager``); None when no manager is active."""
        sfm = self._active_sfm()
        if sfm is None:
            return None
        view = self._adapter.view(forward_batch)
        sfm.pre_ops_maybe_inside_graph(view, verify_later=verify_later)
        return view

    def post_ops_maybe_inside_graph(self, view: Optional[ForwardView]) -> None:
        """TAIL write for the forward that just ran."""
        sfm = self._active_sfm()
        if sfm is None or view is None:
            return
        if self.token_oracle is not None:  # an eager extend's fed tokens, left for here (outside pre-ops)
            self.token_oracle.stage_fed()
        sfm.post_ops_maybe_inside_graph(view)

    def verify_deferred_on_error(self, view: Optional[ForwardView]) -> None:
        """The forward raised before the model's last stage, where its HEAD verify waited: run it now, so what its
        layers read is counted before the error propagates (``report_before_engine_error`` reports it)."""
        sfm = self._active_sfm()
        if sfm is not None and view is not None:
            sfm.verify_deferred(view)

    def _active_sfm(self) -> Optional[SingleForwardManager]:
        if not self._active:
            if self.init_finished and not self._capturing:
                raise CanaryBracketError(
                    "kv-canary: model.forward ran with no active single-forward manager after init; "
                    "this forward path is not wired (it would write KV the canary never fingerprints)"
                )
            return None
        return self.single_forward_managers[self._active[-1]]

    def _on_eager_tail(self) -> None:
        if not self._capturing:
            self._eager_tails += 1

    def _post_ops_outside_graph(self, fb: object, expected_forwards: int) -> None:
        if not self.init_finished:
            return
        if self.host_records is not None:
            self._check_load_consumed()
        if self.token_oracle is not None and self.token_oracle.fed_unstaged:
            self.token_oracle.forget_fed()
            raise CanaryBracketError("kv-canary: an eager extend's fed tokens were left for its TAIL, which did not "
                                     "run on the host (a CUDA-graph replay?): its fed tokens went unchecked")
        if self.perturb.active:
            self.perturb.perturb_post_forward(forward_index=self.forwards,
                                              written=lambda: self._adapter.written_slots(fb))
        self.outer_steps += 1
        replayed = self._eager_tails == 0
        if replayed:  # a CUDA-graph replay: the TAIL ran inside the graph
            ran = expected_forwards if self._adapter.batch_size(fb) > 0 else 0
            self.graph_forwards += ran
        else:
            ran = self._eager_tails
        if ran == 0:
            return
        self._wait_steps = 0 if replayed or not self.eager_steps_waiting else self._wait_steps + 1
        rids = self._adapter.rids(fb) or ()
        if self.transfer is not None:
            self.transfer.forward_ran(rids)
        self._expected_written += ran * self._adapter.num_tokens(fb) * len(self.groups)
        for _ in range(ran):
            self._forward_info[self.forwards % RID_HISTORY] = (self.forwards, rids, replayed)
            self.forwards += 1
        self._expected_written_at.append((self.forwards, self._expected_written, self._deferred_write_launches))
        self._deferred_uncopied = False
        if self.cache_index is not None and self.cache_index.pending:
            self.cache_index.apply_pending()  # each forward's tree changes, a few at a time, not in a burst per sweep
        if self._sweep_due():
            self.sweep()
        if self._d2h.full:  # steps left their poll: read the landed copies before queuing one more (no wait)
            self._catch_up()
        self._d2h.snapshot(self.forwards)
        if self._wait_steps == 0 or self._wait_steps > self.eager_steps_waiting:
            self._catch_up()

    def _catch_up(self) -> None:
        """Host bookkeeping that may wait for a graph replay (``EAGER_STEPS_WAITING``): the token oracle remembers
        the last extends' fed prompts' chains, the landed counter copies are read (violations logged or raised)."""
        self._remember_waiting()
        self.poll()

    def _remember_waiting(self) -> None:
        """The token oracle remembers the chains eager steps left waiting (the next admission would itself)."""
        self._wait_steps = 0
        if self.token_oracle is not None:
            self.token_oracle.remember_fed()

    def _sweep_due(self) -> bool:
        every = self.config.sweep_interval
        return (bool(every) and self._prefix_cache is not None and self.cache_index is not None
                and self.forwards // every > self._swept_at // every)

    def sweep(self) -> None:
        """Verify every slot the prefix cache holds (outside any graph, no host sync).

        Bound: the tree changes are replayed into the device index after every forward (a
        constant number of launches per run of changes, ~25 us of host work per 1k cached
        tokens), so a sweep is one launch per group over the pool's ``num_slots`` lanes that
        checks every held slot (H200, 131k-slot pool: ~60 us host, ~80 us device;
        docs/history/performance.md).
        """
        self._prefix_cache.before_sweep()  # a tree that is walked, not followed, refreshes the index now
        self.cache_index.apply_pending()
        for group_index, group in enumerate(self.groups):
            self.kernels.sweep_index(group, self.cache_index, self.counters, self.ring, group_index=group_index)
        self._swept_at = self.forwards
        self.sweeps += 1

    def poll(self, *, drain: bool = False) -> None:
        """Handle every counter copy that has landed; log or raise on new violations (``drain``: idle; every copy,
        the bookkeeping eager steps left waiting, and HiCache's batched backups and frees, which would otherwise
        wait for an ack check that may come only with the next batch: ``--sleep-on-idle``)."""
        if drain:
            self._remember_waiting()
            self.flush_host_records()
        if drain and self._deferred_uncopied:
            self._copy_deferred()
        if drain:  # the last forward's counters, whatever the copy interval
            self._d2h.flush(self.forwards)
        ready = self._d2h.drain() if drain else self._d2h.ready(self.forwards)
        for step, host_counters in ready:
            self._check_health(step, host_counters)
            self._handle_counters(host_counters, catch_up=drain)
        if self.host_scrub is not None:  # HiCache: bad host copies the host scrub found at rest
            found = self.host_scrub_violations()
            if found:
                self._report(found, 0)
        if drain and self.forwards != self._settled_forward:
            # Settled: the host has read everything the device counted up to now.
            self._settled_forward = self.forwards
            self._last_stats_forward = self.forwards
            logger.info(self.stats_line() + " settled=1")
            if self.config.swa_divergence_stats_interval and self.last_counters is not None:
                self._last_swa_forward = self.forwards
                logger.info(SwaDivergenceLog.from_counters(self.last_counters).format() + " settled=1")

    # ------------------------------------------------------------------ between forwards

    def record_sampled(self, sampled: torch.Tensor) -> None:
        """The tokens the scheduler just sampled (int device tensor, batch order) join the token oracle.

        Called after each sampling step, outside any graph: one device copy (the next forward's HEAD scatters).
        """
        sink = self._sample_sink
        if sink is not None:
            sink(sampled)

    def note_request_tokens(self, row: int, rid: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Token oracle: admit request ``rid`` (req_to_token row ``row``) with the scheduler's record of its tokens.

        For a request whose KV no forward of this server computed (PD decode side:
        it arrived by transfer), called when sglang builds the prebuilt batch.
        """
        if self.token_oracle is not None:
            self.token_oracle.init_row(row, prompt_ids, output_ids)
