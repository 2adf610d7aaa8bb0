"""The no-server benches' result: printed as JSON, and written to ``--out`` when given."""

from __future__ import annotations

import json
from typing import Optional


def emit(result: dict, out: Optional[str]) -> int:
    """Print ``result`` (indented JSON) and write it to ``out`` (None: print only); the script's exit code (0)."""
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
