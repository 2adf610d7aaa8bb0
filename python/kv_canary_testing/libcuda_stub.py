"""Build a stand-in ``libcuda.so.1`` for machines without an NVIDIA driver.

sglang 0.5.12 imports the CUDA build of ``sgl_kernel`` unconditionally, and that
library links against ``libcuda.so.1``. On the CPU path no CUDA driver call is
ever made, so a library that exports the needed symbols, each returning a CUDA
error code, is enough for the import to succeed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kv_canary_testing import default_cache_dir

CUDA_ERROR_UNKNOWN = 999

STUB_SYMBOLS = (
    "cuGetErrorString",
    "cuMemAddressFree",
    "cuMemGetAddressRange_v2",
    "cuMemRelease",
    "cuMemRetainAllocationHandle",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuPointerGetAttribute",
)


def stub_source() -> str:
    """Return the C source of the stand-in driver library."""
    lines = [
        "/* Stand-in libcuda.so.1 for CPU-only machines (kv_canary_testing). */",
        f"#define KVC_STUB_ERR {CUDA_ERROR_UNKNOWN}",
        "int cuGetErrorString(int err, const char **str) {",
        '    (void)err; if (str) *str = "no CUDA driver (kv_canary_testing libcuda stub)";',
        "    return KVC_STUB_ERR;",
        "}",
    ]
    for name in STUB_SYMBOLS:
        if name == "cuGetErrorString":
            continue
        lines.append(f"int {name}(void) {{ return KVC_STUB_ERR; }}")
    return "\n".join(lines) + "\n"


def ensure_libcuda_stub(cache_dir: str | os.PathLike | None = None) -> Path:
    """Compile the stub (once per source hash) and return the folder for LD_LIBRARY_PATH."""
    source = stub_source()
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir = base / f"libcuda-stub-{digest}"
    lib = out_dir / "libcuda.so.1"
    if lib.is_file():
        return out_dir

    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("gcc (or cc) is needed to build the libcuda stub")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "libcuda_stub.c"
        src.write_text(source)
        tmp_lib = Path(tmp) / "libcuda.so.1"
        cmd = [gcc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1",
               "-o", str(tmp_lib), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"building the libcuda stub failed ({proc.returncode}):\n{proc.stderr}"
            )
        os.replace(tmp_lib, lib)  # atomic: concurrent builders are harmless
    return out_dir
