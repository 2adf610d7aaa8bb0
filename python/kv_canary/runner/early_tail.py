"""TAIL at the start of the model's last stage, beside it (``EarlyTail``).

A forward's KV is complete once every layer has stored its K/V; what runs after that (the final norm, the LM
head's GEMM over the whole vocabulary, the logits' post-processing) never touches the KV. The TAIL (witness
check, fingerprint write, the whole-row hash) needs exactly that point, not the forward's end. So when the
engine names the module that starts the last stage (the *anchor*: sglang's ``logits_processor``), the TAIL runs
from a forward pre-hook on that module, on a side stream that forks from the forward's stream there and joins it
again when the patched ``model.forward`` returns (inside the CUDA graph when the forward is captured: a fork and
a join of the capture). The TAIL's few small launches then overlap the LM head's memory-bound GEMM instead of
following it. HEAD's verify moves there too, in front of the TAIL (``SingleForwardManager``'s ``verify_later``):
the forward writes none of the slots it reads, so their records and bytes are the ones HEAD would have read, and
only the write witness's stamp (which must precede the stores) stays before the forward. A decode step at bs 8 x
1,216 tokens with a 128k-vocabulary LM head on an H100 (``benchmarks/bench_decode_kernels.py --lm-head 128256``): the
canary's cost in the step 29.4 us with the TAIL after the forward, 13.1 us with the TAIL beside the LM head.

A forward that never reaches the anchor (a pipeline stage before the last, an embedding model's pooler, a
forward path without logits) runs its TAIL after the forward, as without an anchor. On a CPU (no streams) the
TAIL runs at the anchor, in line.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..views import ForwardView


class EarlyTail:
    """Runs ``tail(view)`` at the anchor's forward pre-hook for the armed forward; ``finish`` joins it back."""

    def __init__(self, anchor: torch.nn.Module, tail: Callable[[ForwardView], None], device: torch.device):
        if not isinstance(anchor, torch.nn.Module):
            raise TypeError(f"kv-canary: the TAIL's anchor must be a torch module, got {type(anchor).__name__}")
        self._tail = tail
        self._view: Optional[ForwardView] = None  # the armed forward's (None: the hook does nothing)
        self._ran = False
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.early_tails = 0  # forwards whose TAIL ran at the anchor (host count, for tests and the stats)
        anchor.register_forward_pre_hook(self._at_anchor)

    def arm(self, view: ForwardView) -> None:
        """The forward about to run: its TAIL runs at the anchor, if the forward reaches it."""
        self._view, self._ran = view, False

    def _at_anchor(self, module, args) -> None:
        view, self._view = self._view, None
        if view is None:  # not armed, or the anchor's second call in one forward
            return None
        self._ran = True
        self.early_tails += 1
        if self._stream is None:
            self._tail(view)
            return None
        forward_stream = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(forward_stream)  # every layer's K/V store is queued before this point
        with torch.cuda.stream(self._stream):
            self._tail(view)
        return None

    def finish(self) -> bool:
        """After the forward: True if its TAIL ran at the anchor (the forward's stream now waits for it), False if
        the caller must run it."""
        self._view = None
        ran, self._ran = self._ran, False
        if ran and self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return ran
