"""A HiCache load-back's first-read hashing, layer by layer as the engine's per-layer copies land.

The forward that consumes a load (``HostCopies.load_in_flight``) lists the loaded slots in HEAD (their first-read
tag was zeroed at the load, so HEAD's verify lists them). Their whole rows are then hashed in ``parts`` runs of
whole layers: each part is queued on a side stream behind the load event of its last layer (``LoadWaits.layer``,
the engine's per-layer event), while the forward runs on its own stream (it waits for each layer itself); the
finalize then compares every listed slot's sum with its FULL_HASH and empties the list. TAIL's write waits for
the side stream (``join``) before it bumps the forward counter, so the finalize's violation rows name the
consuming forward, and no later forward lists first reads while this list is in use.

Why: a load from host memory is a copy over PCIe, layer by layer (an 8B-shaped model on an H100: ~1 ms a layer
for 6k slots), and the GPU's memory is idle meanwhile; every part but the last hides behind a later layer's copy.
Hashed after the forward instead (the earlier design), the list cost ~1 ms of the forward's stream per load-back
batch (docs/hicache-results.md 7.4).

On CPU (no streams: the engine's load has finished before the forward) the parts run in HEAD, in order, on the
current stream; the torch reference backend hashes every row at the finalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..buffer_groups import CanaryBufferGroup, KVRow
from ..kernels import CanaryKernels

# runs of whole layers a load's rows are hashed in: on a GPU, the last part (half the rows) is all that runs
# after the last layer landed (on CPU the parts run in order in HEAD). Each part costs the scheduler thread a
# wait and a launch while it launches the consuming (eager) extend, that batch's critical path when its host
# launches outlast the load: eight parts took 1,060 us of host time a load-consuming extend (H200, the HiCache
# row, docs/results/gpu-h200-2026-11-27-host-timers/), against ~0.1 ms of GPU hashing they save after the last
# layer
PARTS = 2


@dataclass(frozen=True)
class LoadWaits:
    """How the current stream waits for a load: ``head()`` for its records and the layers HEAD's verify hashes,
    ``layer(i)`` for layer ``i``'s K/V (the engine's per-layer load event)."""

    head: Callable[[], None]
    layer: Callable[[int], None]


def layer_parts(rows: Sequence[KVRow], parts: int) -> Tuple[Tuple[int, int, int], ...]:
    """(r0, r1, last layer) of up to ``parts`` runs of whole layers over ``rows`` (a group's rows, layer-major:
    layer 0 K, V, layer 1 K, ...); every row in exactly one run."""
    layers = sorted({r.layer for r in rows})
    n = len(layers)
    parts = max(1, min(int(parts), n))
    out = []
    for p in range(parts):
        chunk = set(layers[p * n // parts:(p + 1) * n // parts])
        idx = [i for i, r in enumerate(rows) if r.layer in chunk]
        r0, r1 = idx[0], idx[-1] + 1
        if r1 - r0 != len(idx):
            raise ValueError("kv-canary: a group's rows are not layer-major; a load cannot be hashed by layer")
        out.append((r0, r1, max(chunk)))
    return tuple(out)


class LoadHashing:
    """The first-read hashing of one load at a time (one per ``SingleForwardManager``)."""

    def __init__(self, groups: Sequence[CanaryBufferGroup], kernels: CanaryKernels, counters: torch.Tensor,
                 ring: torch.Tensor):
        cuda = counters.device.type == "cuda"
        self._groups = list(groups)
        self._kernels = kernels
        self._counters = counters
        self._ring = ring
        self._parts = [layer_parts(g.rows, PARTS) for g in self._groups]
        self._stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device=counters.device) if cuda else None
        self._done: Optional[torch.cuda.Event] = torch.cuda.Event() if cuda else None
        self._pending = False

    def start(self, waits: LoadWaits) -> None:
        """After HEAD's verify listed the loaded slots: queue every part behind its layer, then the finalize."""
        stream = self._stream
        if stream is None:
            self._launch(waits)
            return
        main = torch.cuda.current_stream(stream.device)
        stream.wait_stream(main)  # the list HEAD's verify just wrote
        torch.cuda.set_stream(stream)
        try:
            self._launch(waits)
            self._done.record(stream)
        finally:
            torch.cuda.set_stream(main)
        self._pending = True

    def _launch(self, waits: LoadWaits) -> None:
        for group_index, group in enumerate(self._groups):
            for r0, r1, layer in self._parts[group_index]:
                waits.layer(layer)
                self._kernels.first_read(group, self._counters, self._ring, group_index=group_index, rows=(r0, r1),
                                         finalize=False)
            self._kernels.first_read(group, self._counters, self._ring, group_index=group_index, rows=(0, 0),
                                     finalize=True)

    def join(self) -> None:
        """TAIL, before the write: the current stream waits for the finalize (no host wait)."""
        if self._pending:
            torch.cuda.current_stream(self._stream.device).wait_event(self._done)
            self._pending = False
