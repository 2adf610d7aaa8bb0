"""sglang 0.5.21: the 0.5.23 adapter (``v0_5_23``) where 0.5.21 differs from it; a small diff of that line.

0.5.21 ships 0.5.23's in-tree kv_canary call sites and every hook target of the 0.5.23 line with 0.5.23's
signature but one: ``ForwardBatch.init_new`` lacks 0.5.23's ``extend_position_info=, spec_mrope_positions=,
kv_loc_plan=, write_cols=`` (the same hook: it takes ``*args, **kwargs``); the fence expects 0.5.21's signature.
Its own server-args policy (``adapter/policy_0_5_21``: 0.5.23's, on 0.5.21's fields). PD never ran on 0.5.21:
``pd_verified=False``, so the PD gate (``adapter/disagg``) refuses ``--disaggregation-mode``. HiCache stays refused
(``adapter/hicache.VERIFIED_LINES`` names lines, not this one).

Served as a tested release since its CPU smoke passed on its own pins (2026-11-29: ``KVC_SGLANG=0.5.21`` venv,
torch 2.13.0; ``scripts/release_matrix.py``, docs/compatibility.md); ``contain`` was not part of it.
"""

from __future__ import annotations

import dataclasses

from ..policy_0_5_21 import POLICY_0_5_21
from . import v0_5_23

LINE = dataclasses.replace(v0_5_23.LINE, name="0.5.21", versions=("0.5.21",), untested_versions=(),
                           policy=POLICY_0_5_21, pd_verified=False,
                           spec_target_pools=("MHATokenToKVPool",))  # spec over SWAKVPool: run on 0.5.23 only
