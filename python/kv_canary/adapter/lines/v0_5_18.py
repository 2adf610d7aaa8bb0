"""sglang 0.5.18: the 0.5.17 adapter (``v0_5_17``) where 0.5.18 differs from it; a small diff of that line.

0.5.18 ships the same in-tree kv_canary call sites as 0.5.17 (``install_canary`` bound at import and called after
the KV pool is built, the ``ModelRunner.forward`` bracket, ``with_active_single_forward_manager(0)`` in the decode
capture, the warmups and the flashinfer autotune, ``mark_init_finished`` after graph capture, ``attach_radix_cache``),
the same KV sizing (``KVCacheConfigurator``) and a dataclass ``ServerArgs`` resolved in ``__post_init__``. So this
line is 0.5.17's hooks as they are; what differs:

* ``DecodeCudaGraphRunner.capture_one_shape`` takes ``dsa_variant=`` (the same hook: it passes every argument on);
  the fence expects 0.5.18's signature.
* Its own server-args policy (``adapter/policy_0_5_18``: 0.5.17's, less 2 fields 0.5.18 dropped, plus 16 fields
  0.5.23 has too, classified as 0.5.23's policy classifies them).

Served as a tested release since its CPU smoke passed on its own pins (2026-11-29: ``KVC_SGLANG=0.5.18`` venv,
torch 2.13.0; ``scripts/release_matrix.py``, docs/compatibility.md). 0.5.18 never aborts a disconnected stream
(stock sglang: its tokenizer drops the state first), so the e2e workloads abort through ``/abort_request`` there
(``kv_canary_testing.workload.DISCONNECT_ABORT_LOST``). Not ported, refused at startup naming the flag (as on 0.5.17).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..policy_0_5_18 import POLICY_0_5_18
from . import v0_5_17


def unported(server_args: Any) -> str:
    """The first setting this line's adapter does not verify yet, as a refusal ('' if none)."""
    return v0_5_17.unported_on(server_args, LINE.name)


LINE = dataclasses.replace(v0_5_17.LINE, name="0.5.18", versions=("0.5.18",), untested_versions=(),
                           policy=POLICY_0_5_18, unported=unported)
