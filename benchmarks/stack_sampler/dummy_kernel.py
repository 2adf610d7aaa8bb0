"""A tiny Triton kernel for ``layout_ablations``' ``KVC_DIAG_DUMMY_MODULES``: each ``TAG`` is its own compiled
variant, so its own module loaded into the CUDA context at its first launch."""

import triton
import triton.language as tl


@triton.jit
def dummy_store(out_ptr, TAG: tl.constexpr):
    tl.store(out_ptr + tl.program_id(0), TAG)


def load_modules(device, count: int) -> None:
    """Compile, load and launch ``count`` variants (one program each) on ``device``, then wait for them."""
    import torch

    out = torch.zeros(1, dtype=torch.int32, device=device)
    for tag in range(1, count + 1):
        dummy_store[(1,)](out, TAG=tag)
    if out.is_cuda:
        torch.cuda.synchronize(device)
