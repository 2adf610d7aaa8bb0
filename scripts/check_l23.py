"""Check the sglang 0.5.23 bundle on the GPU host (scripts/gpu_host.sh check-l23, after install-l23).

Prints the versions and where each package was loaded from (/tmp/site23 or the host's own), runs a bf16 CUDA
matmul, a Triton kernel (the host's triton under torch 2.14.1), sgl_kernel's sm90 rmsnorm, and imports the modules
sglang's server processes import at startup (the HTTP server, the scheduler, the model runner). With --flashinfer
also a flashinfer rmsnorm (JIT-built with the host's nvcc: ~1 min the first time). Ends with CHECK_L23 ok, or
CHECK_L23 FAILED and the failed checks (exit status 1).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import sys
import time
import traceback

failed: list[str] = []


def check(name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn()
        print(f"[ok]   {name} ({time.perf_counter() - t0:.1f} s){': ' + detail if detail else ''}", flush=True)
    except BaseException as exc:  # noqa: BLE001 - report every failure, go on with the others
        failed.append(name)
        print(f"[FAIL] {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=6)


def versions() -> str:
    rows = []
    for dist, mod in [("torch", "torch"), ("nvidia-nccl-cu13", None), ("triton", "triton"), ("sglang", "sglang"),
                      ("sglang-kernel", "sgl_kernel"), ("flashinfer-python", "flashinfer"),
                      ("transformers", "transformers"), ("tokenizers", "tokenizers"), ("torchvision", "torchvision"),
                      ("xgrammar", "xgrammar"), ("apache-tvm-ffi", "tvm_ffi"), ("nvidia-cudnn-cu13", None)]:
        try:
            v = md.version(dist)
        except md.PackageNotFoundError:
            v = "absent"
        where = ""
        if mod is not None and mod in sys.modules:
            f = getattr(sys.modules[mod], "__file__", "") or ""
            where = " (/tmp/site23)" if f.startswith("/tmp/site23") else f" ({f.rsplit('/', 2)[0]})"
        rows.append(f"{dist} {v}{where}")
    return "\n       " + "\n       ".join(rows)


def cuda_matmul() -> str:
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = a @ b
    ref = a.float() @ b.float()
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, f"relative error {err}"
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    try:  # torch 2.14.1 wants cuDNN 9.24, the host has 9.19: the first cuDNN use raises (a report, not a failure)
        cudnn = torch.backends.cudnn.version()
    except RuntimeError as exc:
        cudnn = f"unusable ({str(exc).splitlines()[0][:120]})"
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"NCCL {nccl}, cuDNN {cudnn}, "
            f"bf16 4096^3 rel. error {err:.1e}")


def triton_kernel() -> str:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    x = torch.randn(10000, device="cuda")
    y = torch.randn(10000, device="cuda")
    out = torch.empty_like(x)
    add[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
    torch.testing.assert_close(out, x + y)
    return f"triton {triton.__version__}"


def rmsnorm_ref(x, w, eps=1e-6):
    xf = x.float()
    return (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w.float()).to(x.dtype)


def sgl_kernel_rmsnorm() -> str:
    import sgl_kernel
    import torch

    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(sgl_kernel.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w), atol=2e-2, rtol=2e-2)
    return f"sgl_kernel ops from {getattr(sgl_kernel.common_ops, '__file__', '?')}"


def flashinfer_rmsnorm() -> str:
    import flashinfer
    import torch

    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(flashinfer.norm.rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w), atol=2e-2, rtol=2e-2)
    return f"flashinfer {flashinfer.__version__}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flashinfer", action="store_true", help="also a flashinfer rmsnorm (JIT build)")
    args = ap.parse_args()
    check("CUDA bf16 matmul", cuda_matmul)
    check("Triton kernel", triton_kernel)
    check("sgl_kernel rmsnorm (sm90 ops)", sgl_kernel_rmsnorm)
    for mod in ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                "sglang.srt.model_executor.model_runner", "sglang.srt.layers.attention.flashinfer_backend",
                "sglang.srt.layers.attention.triton_backend"):
        check(f"import {mod}", lambda mod=mod: importlib.import_module(mod) and None)
    if args.flashinfer:
        check("flashinfer rmsnorm (JIT)", flashinfer_rmsnorm)
    check("versions", versions)
    print("CHECK_L23 ok" if not failed else f"CHECK_L23 FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
