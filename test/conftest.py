"""Make the in-repo packages (kv_canary, kv_canary_testing) importable without installing."""

import sys
from pathlib import Path

_PYTHON_DIR = str(Path(__file__).resolve().parent.parent / "python")
if _PYTHON_DIR not in sys.path:
    sys.path.insert(0, _PYTHON_DIR)
