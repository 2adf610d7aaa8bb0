"""PD disaggregation on CPU for the e2e tests (test-only): sglang 0.5.23's prefill sends page indices it computed
on the host.

Stock sglang 0.5.23 cannot send KV by PD on CPU: for a sender that ``supports_host_tensor_indices`` (mooncake's),
``SchedulerDisaggregationPrefillMixin._send_kv_chunk`` copies the page indices into pinned memory and records a
``torch.cuda.Event`` for the transfer worker to wait on ("Found no NVIDIA driver" on CPU). With the class attribute
off, the same method computes them with ``kv_to_page_indices`` on the scheduler thread, sglang's path for the other
senders; the transfer, its buffers, the bootstrap and the decode side run unchanged, and so does the canary. The
GPU host runs the pinned path (issue 52). One flag completes it (``server_args``): the prefill runs without the
overlap scheduler (its early send of a cached prefix records a ``torch.cuda.Event`` on the forward stream when
overlapping; the early send itself still runs). 0.5.12 needs none of this. (The decode side's
``--disaggregation-decode-retraction-backup cpu_tensor`` is the canary's, on every device: ``pd.line_args``.)

Enabled by the PD fixture's env (``KVC_TEST_PD_CPU=1``, read when the tiny model package is imported in the scheduler
process), never by the plugin.
"""

from __future__ import annotations

import os

ENV = "KVC_TEST_PD_CPU"


def server_args(mode: str) -> list:
    """The flags one side of a CPU PD deployment needs on the installed sglang ([] on 0.5.12)."""
    from kv_canary_testing.line_suites import installed_line

    if installed_line() != "0.5.23" or mode != "prefill":
        return []
    return ["--disable-overlap-schedule"]


def install() -> None:
    """Turn off the pinned-index path of mooncake's sender, where the installed sglang has one (idempotent)."""
    try:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    except ImportError:  # PD extras not installed: nothing sends
        return
    if getattr(MooncakeKVSender, "supports_host_tensor_indices", False):
        MooncakeKVSender.supports_host_tensor_indices = False


def install_if_enabled() -> None:
    if os.environ.get(ENV) == "1":
        install()
