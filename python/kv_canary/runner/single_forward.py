"""``SingleForwardManager``: the canary work of one model forward, safe inside a CUDA graph.

HEAD (before the forward): one verify launch per buffer group over every slot
attention will read, then (the write witness, ``kernels/witness.py``) one launch per group that stamps
every K/V row of every slot the forward is meant to fill; TAIL first checks that every stamp is gone
(``unwritten`` otherwise). TAIL (after the forward): one write launch per group over
every slot the forward filled, recording the token and position the model was
fed; the first group's launch also checks them (position = the slot's index in
the sequence, token = the request's own token from the token oracle), the last
group's launch bumps the device forward counter. With the scrub on, HEAD also
checks every K/V byte of a fixed number of slots (round-robin over the pool)
and TAIL records every new slot's whole-row hash. A forward whose K/V stores its TAIL does not record
(``ForwardView.unrecorded_stores``: spec v1's draft scratch slots, a tree verify's nodes) first has HEAD forget
those slots' records, so neither the scrub nor a later read checks bytes the forward changed against a previous
owner's record. Both only launch kernels on
preallocated buffers: no host sync, no allocation, grids fixed by the batch size
(see ``LaunchCapacities``).

A forward that consumes a HiCache load-back (``expect_load``) waits in HEAD for the load's records and the
layers its verify hashes, and hashes the loaded slots' full rows (the first-read LIST) layer by layer as they
land, on a side stream beside the forward (``load_hashing``); TAIL's write waits for that hashing (its rows then
name this forward); the scrub moves after the write.

Everything runs on the forward's stream, in order: HEAD, the forward, TAIL. (HEAD on
a side stream beside the forward was measured and dropped: at decode bs32 on an H200
the verify ran 2.2x slower beside the forward's GEMMs and the step got longer, not
shorter; docs/history/performance.md.)
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..kernels import VERIFY_BLOCK, CanaryKernels
from ..speculative import stage_verify_tokens
from ..token_oracle import TokenOracle
from ..views import ForwardView, LaunchCapacities
from ..buffer_groups import CanaryBufferGroup
from .load_hashing import LoadHashing, LoadWaits


class SingleForwardManager:
    def __init__(
        self,
        *,
        index: int,
        groups: Sequence[CanaryBufferGroup],
        kernels: CanaryKernels,
        req_to_token: torch.Tensor,
        counters: torch.Tensor,
        ring: torch.Tensor,
        capacities: LaunchCapacities,
        on_tail: Callable[[], None],
        token_oracle: Optional[TokenOracle] = None,
        scrub_slots_per_forward: int = 0,
        check_fed: bool = True,
        write_witness: bool = True,
    ):
        self.index = index
        self._groups = list(groups)
        self._kernels = kernels
        self._req_to_token = req_to_token
        self._counters = counters
        self._ring = ring
        self._capacities = capacities
        self._on_tail = on_tail  # host callback: counts eager forwards
        # each request's own tokens (None: no token check): HEAD compares the read prefix's chain with it
        # (``verify_reads``), TAIL checks what the forward is fed; both keep it up to date
        self._oracle = token_oracle
        self._check_fed = check_fed
        self._scrub = scrub_slots_per_forward  # slots per forward whose every K/V byte is checked (0: off)
        self._witness = write_witness  # stamp the slots to fill in HEAD, require every stamp gone in TAIL
        self._load_waits: Optional[LoadWaits] = None  # a HiCache load the next forward consumes
        self._defer_full_rows = False  # this forward's scrub runs after its TAIL, its first reads beside it
        self._verify_pending = False  # HEAD left this forward's verify to its TAIL (``verify_later``)
        self.load_hashing: Optional[LoadHashing] = None  # a load's first-read hashing (``attach_load_hashing``)

    def attach_load_hashing(self) -> None:
        """HiCache is on: this manager's forwards may consume loads, hashed by layer (``load_hashing``)."""
        self.load_hashing = LoadHashing(self._groups, self._kernels, self._counters, self._ring)

    def expect_load(self, waits: Optional[LoadWaits]) -> None:
        """The next forward consumes a HiCache load: HEAD calls ``waits.head()`` first, then hashes the loaded
        slots' rows behind ``waits.layer`` (``load_hashing``); the scrub moves after TAIL. ``None``: forget one."""
        if waits is not None and self.load_hashing is None:
            raise ValueError("kv-canary: a HiCache load was handed to a forward manager without load hashing "
                             "(attach_load_hashing): its slots would go unhashed")
        self._load_waits = waits

    @property
    def load_pending(self) -> bool:
        return self._load_waits is not None

    def _scrub_groups(self, after_write: bool = False) -> None:
        """The scrub's window of every group for this forward (HEAD's, or after TAIL's write on a load-back
        forward: ``after_write``, the forward counter already bumped)."""
        for group_index, group in enumerate(self._groups):
            self._kernels.scrub(group, self._counters, self._ring, self._scrub, group_index=group_index,
                                after_write=after_write)

    def pre_ops_maybe_inside_graph(self, view: ForwardView, *, verify_later: bool = False) -> None:
        """HEAD: verify every slot the forward's attention reads, then stamp the slots it fills.

        ``verify_later``: the TAIL runs at the model's last stage (``runner/early_tail.py``) and the verify moves
        there too, ahead of it: the forward writes none of the slots it reads, so their records and bytes are the
        same there, and HEAD keeps only the stamp on the forward's critical path. Not for a forward that consumes
        a HiCache load (its verify lists the loaded slots, hashed as the layers land)."""
        if view.batch_size == 0:
            return
        self._capacities.check(view)
        if view.unrecorded_stores:  # before the scrub: the forward changes those slots' bytes and records none
            stores = view.out_cache_loc[: view.store_lanes]
            for group in self._groups:
                group.forget(stores)
        waits, self._load_waits = self._load_waits, None
        if waits is not None:
            waits.head()
        self._defer_full_rows = waits is not None
        if self._scrub and not self._defer_full_rows:
            self._scrub_groups()
        self._verify_pending = verify_later and waits is None
        if not self._verify_pending:
            self._verify(view)
        if self._witness:  # after the scrub and any verify here: they read the slots' old bytes
            for group_index, group in enumerate(self._groups):
                self._kernels.witness_stamp(group, view, group_index=group_index)
        if waits is not None:  # the verify above listed the loaded slots
            self.load_hashing.start(waits)

    def verify_deferred(self, view: ForwardView) -> None:
        """The verify HEAD left for the TAIL (``verify_later``), when the TAIL will not run: the forward raised before
        the model's last stage. Its stores may have stopped part-way, so no TAIL."""
        if view.batch_size and self._verify_pending:
            self._verify_pending = False
            self._verify(view)

    def _verify(self, view: ForwardView) -> None:
        if self._oracle is not None:  # the admitted prefixes' chains it reads (left for the anchor, or on error)
            self._oracle.stage_admissions()
        programs = self._capacities.verify_programs_per_request(view.batch_size, VERIFY_BLOCK)
        for group_index, group in enumerate(self._groups):
            self._kernels.verify(
                group, view, self._req_to_token, self._counters, self._ring, programs, VERIFY_BLOCK,
                group_index=group_index, token_oracle=self._oracle if group_index == 0 else None,
                defer_first_read=self._defer_full_rows,
            )

    def post_ops_maybe_inside_graph(self, view: ForwardView) -> None:
        """TAIL: fingerprint every slot the forward filled; check the positions and tokens it was fed (after the
        verify HEAD left for it, which lands the oracle's pending samples the checks read)."""
        if view.batch_size == 0:
            return
        if self._verify_pending:
            self._verify_pending = False
            self._verify(view)
        if view.draft_tokens_per_request and self._oracle is not None:
            # drafts are checked by verification, not against the oracle (kv_canary.speculative)
            stage_verify_tokens(self._oracle.staged, view.input_ids, view.batch_size, view.draft_tokens_per_request)
        if self._witness:  # before the writes: their last launch bumps the forward counter
            for group_index, group in enumerate(self._groups):
                self._kernels.witness_check(group, view, self._counters, self._ring, group_index=group_index)
        deferred, self._defer_full_rows = self._defer_full_rows, False
        if deferred:  # before the write: the first reads' rows name this forward
            self.load_hashing.join()
        self._write(view, bump_forward=True)
        if deferred and self._scrub:  # after the write: the slots this forward filled have their records
            self._scrub_groups(after_write=True)
        self._on_tail()

    def deferred_post_ops(self, view: ForwardView) -> None:
        """A TAIL deferred past its forward (a speculative tree verify's kept drafts): the same write launches,
        eager, after the forward was counted (no forward bump, not an eager TAIL of an outer step)."""
        if view.batch_size:
            self._write(view, bump_forward=False)

    def _write(self, view: ForwardView, *, bump_forward: bool) -> None:
        last = len(self._groups) - 1
        for group_index, group in enumerate(self._groups):
            self._kernels.write(
                group, view, self._req_to_token, self._counters, self._ring, bump_forward and group_index == last,
                group_index=group_index, check_fed=self._check_fed and group_index == 0,
                token_oracle=self._oracle if group_index == 0 else None,
            )
