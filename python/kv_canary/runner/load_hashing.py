"""A HiCache load-back's first-read hashing, layer by layer as the engine's per-layer copies land.

The forward that consumes a load (``HostCopies.load_in_flight``) lists the loaded slots in HEAD (their first-read
tag was zeroed at the load, so HEAD's verify lists them). Their whole rows are then hashed in runs of whole
layers, the last runs short (``LAST_RUNS``): each run is queued on a side stream behind the load event of its
last layer (``LoadWaits.layer``, the engine's per-layer event), while the forward runs on its own stream (it
waits for each layer itself); the finalize then compares every listed slot's sum with its FULL_HASH and empties
the list. TAIL's write waits for the side stream (``join``) before it bumps the forward counter, so the
finalize's violation rows name the consuming forward, and no later forward lists first reads while this list is
in use.

Why: a load from host memory is a copy over PCIe, layer by layer (an 8B-shaped model on an H100: ~1 ms a layer
for 6k slots), and the GPU's memory is idle meanwhile; every run but the last hides behind a later layer's copy.
Hashed after the forward instead (the earlier design), the list cost ~1 ms of the forward's stream per load-back
batch (docs/history/hicache.md 7.4).

On CPU (no streams: the engine's load has finished before the forward) the runs go in HEAD, in order, on the
current stream; the torch reference backend hashes every row at the finalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..buffer_groups import CanaryBufferGroup, KVRow
from ..kernels import CanaryKernels

# the last runs' layer counts, the last run last; the layers before them form the first run. A load lands layer by
# layer (an 8B shape on an H200: ~1 ms a layer of ~9.3k slots over PCIe) and one layer's rows hash ~30x faster
# (~35 us), so each run hides behind the copies of the layers after it: the first (all but the last 5 layers)
# behind the last 5 layers' copies, the next 4 layers behind the last one's, and only the last layer's hash runs
# after the whole load landed, beside that layer's compute (two even runs left half the rows, ~0.54 ms, for
# then: on the batch's critical path, since the consuming extend's end waits for the load; H200 profile,
# docs/results/gpu-h200-2026-11-28-tail-runs/). Each run costs the scheduler thread a wait and a launch while it
# launches the extend (eight even runs: 1,060 us of host time an extend, docs/history/hicache.md 7.11): three runs
LAST_RUNS = (4, 1)


@dataclass(frozen=True)
class LoadWaits:
    """How the current stream waits for a load: ``head()`` for its records and the layers HEAD's verify hashes,
    ``layer(i)`` for layer ``i``'s K/V (the engine's per-layer load event)."""

    head: Callable[[], None]
    layer: Callable[[int], None]


def layer_parts(rows: Sequence[KVRow], last_runs: Sequence[int] = LAST_RUNS) -> Tuple[Tuple[int, int, int], ...]:
    """(r0, r1, last layer) of runs of whole layers over ``rows`` (a group's rows, layer-major: layer 0 K, V, layer 1
    K, ...), in layer order: the last runs hold ``last_runs`` layers each (the last run last), the first the layers
    before them (runs left empty by a model with fewer layers are dropped); every row in exactly one run."""
    layers = sorted({r.layer for r in rows})
    if any(int(k) < 1 for k in last_runs):
        raise ValueError(f"kv-canary: a run holds at least one layer, got {tuple(last_runs)}")
    cuts, end = [], len(layers)
    for k in reversed(tuple(last_runs)):
        if end <= 0:
            break
        cuts.append(max(0, end - int(k)))
        end = cuts[-1]
    bounds = sorted({0, *cuts, len(layers)})
    out = []
    for a, b in zip(bounds, bounds[1:]):
        chunk = set(layers[a:b])
        idx = [i for i, r in enumerate(rows) if r.layer in chunk]
        r0, r1 = idx[0], idx[-1] + 1
        if r1 - r0 != len(idx):
            raise ValueError("kv-canary: a group's rows are not layer-major; a load cannot be hashed by layer")
        out.append((r0, r1, layers[b - 1]))
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
        self._parts = [layer_parts(g.rows) for g in self._groups]
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
