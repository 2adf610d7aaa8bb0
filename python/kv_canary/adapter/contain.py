"""The sglang side of ``--kv-canary contain``: abort requests by rid and evict radix-cache nodes by slot.

This is sglang 0.5.12's (``RadixCache``'s Python nodes); 0.5.23's scheduler and ``UnifiedRadixCache``
are in ``contain_unified`` (a subclass, chosen by ``SglangLine.containment``).

``SchedulerContainment.submit`` (called from ``CanaryManager.poll``, inside a
forward) only queues; ``apply`` runs at the scheduler's next safe point -- right
after ``Scheduler.process_input_requests``, where sglang itself handles
``AbortReq`` -- and before the next batch is scheduled, so a retry that arrived
in the meantime is matched against a tree that no longer holds the bad slots.

* Abort, the way sglang aborts: a running request gets ``to_finish =
  FINISH_ABORT(message)`` (it finishes after one more forward and frees its KV
  through sglang's own path); a queued one is removed and answered with
  ``AbortReq``. Aborted requests are marked ``skip_radix_cache_insert`` so their
  KV is freed, not inserted into the tree -- except a request still in chunked
  prefill: sglang re-matches its prefix from the tree before each chunk, so with
  its chunks not inserted it prefilled again from an earlier prefix, chunk after
  chunk, leaking slots until the pool ran out (seen on an H200, 0.5.12, overlap
  scheduler); it finishes its chunks, and its bad slots stay pending until it
  releases them and are evicted then.
* Abort the holders of a slot found at rest (the sweep's and the scrub's rows name no reader): every in-flight
  request whose ``req_to_token`` row holds the slot at the reported position (``_holder_aborts``; it reads it at
  its next forward), before the evictions; the canary counts them (``on_holders_aborted``). A holder aborted
  here before (it keeps the slot until its last forward) is not aborted, logged or counted again: the rids of
  the last ``ABORTED_MEMORY`` aborts are remembered.
* Evict: the radix node holding a bad slot and its whole subtree (HiCache: from the host too,
  ``contain_hicache``), children
  first, each freed once through the allocator and removed with the tree's own
  ``_delete_leaf`` (the same calls as ``RadixCache.evict``). A node still locked
  by a running request (lock_ref > 0; locks propagate to ancestors) is retried
  at later safe points until the aborted requests have released it; a slot that
  stays unheld or locked is dropped after ``PENDING_TTL`` safe points (a later
  hit on it is detected and contained again).

Tensor parallel: each rank verifies its own KV shard, so a corrupt byte of one
rank's shard is seen by that rank alone, while every rank must abort the same
requests and evict the same nodes at the same point (their schedulers run in
lockstep). At every safe point the ranks agree on what is pending: one gloo
all-reduce of a count over sglang's TP CPU group, and only when it is non-zero an
all-gather of the orders, merged the same way on every rank (per request, the
message of the lowest rank that has one). Cost: one small CPU collective per
scheduler iteration, in contain mode with ``--tp-size`` > 1 only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Dict, List, Tuple

from ..containment import ContainOrder
from ..violations import CONTAIN_PREFIX, format_line
from .contain_hicache import (evict_hicache_subtree, host_slot_holders, is_hicache_tree, subtree_busy,
                              subtree_children_first)

logger = logging.getLogger("kv_canary")

PENDING_TTL = 1024  # safe points a bad slot no cache node holds stays pending
ABORTED_MEMORY = 4096  # rids of the latest requests aborted here, not aborted again as holders


class SchedulerContainment:
    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._tp_size = int(getattr(scheduler, "tp_size", 1) or 1)
        self._tp_group = getattr(scheduler, "tp_cpu_group", None) if self._tp_size > 1 else None
        # submitted here since the last agreement (TP): aborts, slots, held (slot, position) -> message
        self._new: Tuple[Dict[str, str], List[int], Dict[Tuple[int, int], str]] = ({}, [], {})
        self.exchanges = 0  # safe points at which the TP ranks exchanged orders
        self._aborts: Dict[str, str] = {}
        self._held: Dict[Tuple[int, int], str] = {}  # bad slots found at rest: (slot, position) -> holders' message
        self._holders_listener = None
        # a bad copy -> safe points left; keyed (tier, slot): ("slot", device slot) or ("host_slot", HiCache host slot)
        self._slots: Dict[Tuple[str, int], int] = {}
        self._aborted_rids: "OrderedDict[str, None]" = OrderedDict()  # bounded: ABORTED_MEMORY
        self.aborted = 0
        self.evicted_nodes = 0
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ ContainmentTarget

    def submit(self, order: ContainOrder) -> None:
        held = {(slot, position): message for slot, position, message in order.held_slots}
        if self._tp_group is not None:  # queued for the ranks' agreement at the next safe point
            for rid, message in order.aborts.items():
                self._new[0].setdefault(rid, message)
            self._new[1].extend(order.slots)
            for key, message in held.items():
                self._new[2].setdefault(key, message)
            return
        self._queue(order.aborts, order.slots, order.host_slots, held)

    def on_holders_aborted(self, callback) -> None:
        """``callback(rids)`` after the holders of bad slots found at rest were aborted (the canary counts them)."""
        self._holders_listener = callback

    def _queue(self, aborts: Dict[str, str], slots, host_slots=(), held=None) -> None:
        for rid, message in aborts.items():
            self._aborts.setdefault(rid, message)
        for key, message in (held or {}).items():
            self._held.setdefault(key, message)
        for slot in slots:
            self._slots[("slot", slot)] = PENDING_TTL
        for host_slot in host_slots:  # HiCache (TP is refused with it, so the TP exchange carries device slots only)
            self._slots[("host_slot", host_slot)] = PENDING_TTL

    # ------------------------------------------------------------------ safe point

    def _agree(self) -> None:
        """TP: every rank queues the union of all ranks' new orders (same order, same messages)."""
        import torch
        import torch.distributed as dist

        aborts, slots, held = self._new
        pending = torch.tensor([len(aborts) + len(slots) + len(held)], dtype=torch.int64)
        dist.all_reduce(pending, group=self._tp_group)
        if int(pending[0]) == 0:
            return
        gathered: List[object] = [None] * self._tp_size
        dist.all_gather_object(gathered, (aborts, sorted(set(slots)), held), group=self._tp_group)
        self._new = ({}, [], {})
        self.exchanges += 1
        for rank_aborts, rank_slots, rank_held in gathered:  # rank order: the lowest rank's message wins
            self._queue(rank_aborts, rank_slots, held=rank_held)

    def apply(self) -> None:
        if self._tp_group is not None:
            self._agree()
        holders: Dict[str, str] = {}
        if self._held:  # before the evictions: the holders' locks keep the node until they release it
            held, self._held = self._held, {}
            # a holder aborted at an earlier safe point still holds the slot until its last forward: not again
            holders = {rid: m for rid, m in self._holder_aborts(held).items()
                       if rid not in self._aborts and rid not in self._aborted_rids}
            self._aborts.update(holders)
        if self._aborts:
            aborts, self._aborts = self._aborts, {}
            state = self._abort(aborts)
            aborted = [rid for rid in holders if state.get(rid) == "aborted"]
            if aborted and self._holders_listener is not None:
                self._holders_listener(aborted)
        if self._slots:
            self._evict()

    def _holder_aborts(self, held: Dict[Tuple[int, int], str]) -> Dict[str, str]:
        """rid -> message of every in-flight request whose row holds a bad slot at its position: it reads it at its
        next forward. One gather of ``req_to_token`` and one host read, on the violation path only."""
        import torch

        reqs, rows, lens = [], [], []
        for req in self._inflight_reqs():
            row, n = self._kv_row(req)
            if row is not None and n > 0 and not req.finished():
                reqs.append(req)
                rows.append(int(row))
                lens.append(int(n))
        if not reqs:
            return {}
        table = self._scheduler.req_to_token_pool.req_to_token  # int32[rows, max_context_len]
        keys = list(held)
        dev = table.device
        pos = torch.tensor([p for _, p in keys], dtype=torch.int64, device=dev)
        slots = torch.tensor([s for s, _ in keys], dtype=table.dtype, device=dev)
        vals = table[torch.tensor(rows, dtype=torch.int64, device=dev)[:, None],
                     pos.clamp(max=table.shape[1] - 1)[None, :]]
        hit = ((vals == slots[None, :]) & (pos[None, :] < torch.tensor(lens, device=dev)[:, None])).cpu()
        out: Dict[str, str] = {}
        for i, req in enumerate(reqs):
            cols = hit[i].nonzero().flatten().tolist()
            if cols and req.rid not in out:
                out[req.rid] = held[keys[cols[0]]]
        return out

    def _abort(self, aborts: Dict[str, str]) -> Dict[str, str]:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        s = self._scheduler
        found = set()
        state: Dict[str, str] = {}  # rid -> aborted | finished (before the abort reached it)
        for req in self._inflight_reqs():
            message = aborts.get(req.rid)
            if message is None or req.rid in found:
                continue
            found.add(req.rid)
            if not (req is getattr(s, "chunked_req", None) or getattr(req, "is_chunked", 0) > 0):
                req.skip_radix_cache_insert = True
            if req.finished():
                state[req.rid] = "finished"
            else:
                req.to_finish = FINISH_ABORT(message=message)
                state[req.rid] = "aborted"
        for i in reversed(range(len(s.waiting_queue))):
            req = s.waiting_queue[i]
            message = aborts.get(req.rid)
            if message is None:
                continue
            found.add(req.rid)
            state[req.rid] = "aborted"
            s.waiting_queue.pop(i)
            req.skip_radix_cache_insert = True
            self._answer_queued(req, message)
        for rid in aborts:  # finished/gone: it completed within the detection delay (the stated bound)
            logger.error(format_line(CONTAIN_PREFIX, "abort", {"rid": rid, "state": state.get(rid, "gone")}))
        for rid, v in state.items():
            if v == "aborted":
                self.aborted += 1
                self._aborted_rids[rid] = None
        while len(self._aborted_rids) > ABORTED_MEMORY:
            self._aborted_rids.popitem(last=False)
        return state

    # ------------------------------------------------------------------ what differs per sglang line
    # (0.5.23: contain_unified.UnifiedSchedulerContainment, chosen by SglangLine.containment)

    def _inflight_reqs(self) -> List[object]:
        """The requests a forward may be running for: the running batch, the current/last batch, the chunked one."""
        s = self._scheduler
        running = list(s.running_batch.reqs)
        for batch in (getattr(s, "cur_batch", None), getattr(s, "last_batch", None)):
            if batch is not None and batch is not s.running_batch:
                running += list(batch.reqs)
        if getattr(s, "chunked_req", None) is not None:
            running.append(s.chunked_req)
        return running

    def _kv_row(self, req) -> Tuple[object, int]:
        """(``req_to_token`` row, slots allocated in it) of a request (row None before it has one)."""
        return getattr(req, "req_pool_idx", None), int(getattr(req, "kv_allocated_len", 0) or 0)

    def _answer_queued(self, req, message: str) -> None:
        """A queued request was removed from the waiting queue: answer it with ``AbortReq``."""
        from sglang.srt.managers.io_struct import AbortReq
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        self._scheduler.send_to_tokenizer.send_output(
            AbortReq(rid=req.rid, finished_reason=FINISH_ABORT(message=message).to_json(), abort_message=message),
            req,
        )

    def _retry_later(self, key) -> None:
        """``key`` stays pending one safe point less (dropped after ``PENDING_TTL``)."""
        self._slots[key] -= 1
        if self._slots[key] <= 0:
            del self._slots[key]

    def _evict(self) -> None:
        tree = getattr(self._scheduler, "tree_cache", None)
        device = {slot for tier, slot in self._slots if tier == "slot"}
        holders = {("slot", slot): node for slot, node in _slot_holders(tree, device).items()} \
            if tree is not None and hasattr(tree, "root_node") else {}
        hicache = tree is not None and is_hicache_tree(tree)  # device and host copies go (contain_hicache)
        if hicache:  # a bad host copy is found by its node's host_value
            host = {slot for tier, slot in self._slots if tier == "host_slot"}
            holders.update({("host_slot", h): node for h, node in host_slot_holders(tree, host).items()})
        removed = set()  # ids of nodes evicted in this pass (a slot may sit below an earlier slot's node)
        for key in list(self._slots):
            node = holders.get(key)
            if node is not None and id(node) in removed:
                del self._slots[key]  # already evicted with an ancestor's subtree: free nothing twice
                continue
            busy = node is not None and (subtree_busy(tree, node) if hicache else node.lock_ref > 0)
            if node is None or busy:  # not cached (yet), or a running request (HiCache: or a copy) still holds it
                self._retry_later(key)
                continue
            fields = {key[0]: key[1]}
            if hicache:
                nodes, tokens, host_slots, keys = evict_hicache_subtree(tree, node, removed)
                fields.update(nodes=nodes, tokens=tokens, host_slots=host_slots)
                fields.update(poison_storage_keys(tree, keys))
            else:
                nodes, tokens = _evict_subtree(tree, node, removed)
                fields.update(nodes=nodes, tokens=tokens)
            self.evicted_nodes += nodes
            self.evicted_tokens += tokens
            logger.error(format_line(CONTAIN_PREFIX, "evict", fields))
            del self._slots[key]


def poison_storage_keys(tree, keys) -> Dict[str, int]:
    """The evicted pages' storage keys poisoned (storage has no delete), as a log field; {} without storage."""
    manager = getattr(tree, "kv_canary_manager", None)
    if keys and manager is not None and getattr(manager, "storage_on", False):
        return {"storage_keys_poisoned": manager.poison_storage_keys(keys)}
    return {}


def _slot_holders(tree, slots) -> Dict[int, object]:
    """slot -> the resident radix node whose value holds it (one walk of the tree)."""
    out = {}
    stack = list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.value is None:
            continue
        for s in node.value.tolist():
            if s in slots:
                out[s] = node
    return out


def _evict_subtree(tree, node, removed: set):
    """Free and remove ``node`` and every descendant, children first (each a leaf when removed);
    their ids go into ``removed``."""
    order = subtree_children_first(node)
    tokens = 0
    for n in order:
        if n.value is not None:
            tree.token_to_kv_pool_allocator.free(n.value)
            tokens += len(n.value)
        tree._delete_leaf(n)
        removed.add(id(n))
        if hasattr(tree, "_record_remove_event"):
            tree._record_remove_event(n)
    return len(order), tokens
