"""Test-session setup, loaded before any other conftest or test module.

* Make the in-repo packages (kv_canary, kv_canary_testing) importable without installing.
* Without a CUDA GPU, Triton kernels run under the interpreter: TRITON_INTERPRET=1 must be
  set before anything imports triton (sglang modules imported by other conftests do), since
  triton reads it when kernels are decorated.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_PYTHON_DIR = str(Path(__file__).resolve().parent.parent / "python")
if _PYTHON_DIR not in sys.path:
    sys.path.insert(0, _PYTHON_DIR)
