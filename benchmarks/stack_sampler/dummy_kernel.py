"""A tiny Triton kernel for ``layout_ablations``' ``KVC_DIAG_DUMMY_MODULES``: each ``TAG`` is its own compiled
variant, so its own module loaded into the CUDA context at its first launch; ``UNROLL`` stores (unrolled at
compile time) make its code larger (``KVC_DIAG_DUMMY_UNROLL``)."""

import triton
import triton.language as tl


@triton.jit
def dummy_store(out_ptr, TAG: tl.constexpr, UNROLL: tl.constexpr):
    base = tl.program_id(0) * UNROLL
    for i in tl.static_range(UNROLL):
        tl.store(out_ptr + base + i, TAG + i)


def load_modules(device, count: int, unroll: int = 1) -> int:
    """Compile, load and launch ``count`` variants (one program each, ``unroll`` stores) on ``device``, then wait
    for them; returns their cubins' bytes (0 where there is none: the interpreter)."""
    import torch

    out = torch.zeros(unroll, dtype=torch.int32, device=device)
    cubin = 0
    for tag in range(1, count + 1):
        kernel = dummy_store[(1,)](out, TAG=tag, UNROLL=unroll)
        cubin += len(getattr(kernel, "asm", {}).get("cubin", b"")) if kernel is not None else 0
    if out.is_cuda:
        torch.cuda.synchronize(device)
    return cubin
