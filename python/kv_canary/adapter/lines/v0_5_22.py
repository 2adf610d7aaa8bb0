"""sglang 0.5.22: the 0.5.23 adapter (``v0_5_23``) as it is, expecting 0.5.22's signatures; a small diff of that line.

Every hook target of the 0.5.23 line has 0.5.23's signature on 0.5.22 but the PD sender's (``CommonKVSender.send``
lacks ``indices_event=``): the fence reads this line's targets from 0.5.22's table. PD on 0.5.22 never ran
(``pd_verified=False``): the PD gate (``adapter/disagg``) refuses ``--disaggregation-mode`` here, naming the
release. Same server-args policy (``POLICY_0_5_23``); CPU smoke 2026-11-29 (docs/compatibility.md).
"""

from __future__ import annotations

import dataclasses

from . import v0_5_23

LINE = dataclasses.replace(v0_5_23.LINE, name="0.5.22", versions=("0.5.22",), pd_verified=False,
                           spec_target_pools=("MHATokenToKVPool",))  # spec over SWAKVPool: run on 0.5.23 only
