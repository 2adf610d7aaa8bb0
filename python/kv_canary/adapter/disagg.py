"""PD disaggregation wiring (sglang 0.5.12 and 0.5.23): the canary's records travel with the KV.

Hook bodies (registered by ``sglang_plugin``), reading sglang objects by attribute:

* ``around_init_kv_manager`` (PrefillBootstrapQueue / DecodePreallocQueue
  ``_init_kv_manager``): while the KV manager is built, the pool's
  ``get_contiguous_buf_infos`` returns the KV buffers plus the canary's
  records and origin tensors (``transfer.splice``), so the transfer engine
  registers and copies them with every KV page;
* ``around_send_kvcache`` (MooncakeKVManager.send_kvcache / send_kvcache_slice,
  prefill side): refuse a transfer whose peer registered a different buffer
  list (canary on one side only): the engine would pair the wrong buffers;
* ``before_sender_send`` (MooncakeKVSender.send, prefill side): stamp
  (bootstrap room, slot) into ``origin`` for the pages being sent;
* ``after_get_new_prebuilt_batch`` (decode side): the KV of these requests has
  arrived; give the canary their tokens (token oracle) and identity (a *fake*
  transfer, sglang's warmup / health check, filled nothing: fingerprinted in place);
* ``after_offload_kv_cache`` / ``around_load_kv_cache`` (decode-side
  retraction): the records go to the host and back with the KV.

``check_disaggregation(server_args)`` is the startup gate: which PD
configurations the canary verifies (the others are refused, naming the flag).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

from ..config import FLAG_MODE, CanaryConfig, CanaryConfigError
from ..transfer import Arrival, extra_buf_infos, mark_sent, splice
from .embed_overrides import recorded_prompt

logger = logging.getLogger("kv_canary")

PD_MODES = ("prefill", "decode")
VERIFIED_TRANSFER_BACKENDS = ("mooncake",)


def disaggregation_mode(server_args: Any) -> str:
    """'prefill', 'decode' or 'null'."""
    return str(getattr(server_args, "disaggregation_mode", "null") or "null")


def check_disaggregation(server_args: Any, config: CanaryConfig, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse (``CanaryConfigError``) a PD configuration the canary cannot verify; no-op outside PD.

    Every refusal names the flag or variable and says what to do.
    """
    try:
        _check_disaggregation(server_args, config, environ)
    except CanaryConfigError as e:
        if f"{FLAG_MODE} none" in str(e):
            raise
        raise CanaryConfigError(f"{e}. Change it, or run this server with {FLAG_MODE} none.") from None


def _check_disaggregation(server_args: Any, config: CanaryConfig, environ: Optional[Mapping[str, str]]) -> None:
    environ = os.environ if environ is None else environ
    mode = disaggregation_mode(server_args)
    if mode not in PD_MODES:
        if config.perturb_transfer_prob > 0:
            raise CanaryConfigError(
                "SGLANG_KV_CANARY_PERTURB_TRANSFER_PROB corrupts KV received by PD transfer: it needs "
                "--disaggregation-mode decode"
            )
        return
    if not config.enabled:
        return
    if config.perturb_transfer_prob > 0 and mode != "decode":
        raise CanaryConfigError(
            f"SGLANG_KV_CANARY_PERTURB_TRANSFER_PROB needs --disaggregation-mode decode, not {mode}"
        )
    head = f"{FLAG_MODE} {config.mode.value} with --disaggregation-mode {mode}"
    from .lines import LINE_MODULES, current_line, load_line

    line = current_line()
    if not line.pd_verified:  # a line whose PD hooks never ran on its releases (0.5.21, 0.5.22: 0.5.23's hooks)
        verified = [v for other in map(load_line, LINE_MODULES.values()) if other.pd_verified for v in other.versions]
        raise CanaryConfigError(f"{head} is verified on sglang {', '.join(verified)}, not on sglang {line.name} (its "
                                "PD path never ran there): drop --disaggregation-mode, or use one of those releases")
    backend = str(getattr(server_args, "disaggregation_transfer_backend", "mooncake"))
    if backend not in VERIFIED_TRANSFER_BACKENDS:
        raise CanaryConfigError(
            f"{head} is verified with --disaggregation-transfer-backend {', '.join(VERIFIED_TRANSFER_BACKENDS)} "
            f"only, not {backend}: the canary's records must travel with the KV through the transfer engine"
        )
    for flag, attr, ok in (
        ("--tp-size", "tp_size", 1),
        ("--pp-size", "pp_size", 1),
        ("--dp-size", "dp_size", 1),
    ):
        value = getattr(server_args, attr, ok)
        if attr == "tp_size" and line.pd_tensor_parallel:
            continue  # each rank's KV manager registers its own shard's records (the same TP size on both sides)
        if value is not None and int(value) != ok:
            raise CanaryConfigError(f"{head} is verified with {flag} {ok} only, not {value}")
    page_size = getattr(server_args, "page_size", None)
    if int(page_size or 1) not in line.pd_page_sizes:
        raise CanaryConfigError(f"{head} is verified with --page-size {' or '.join(map(str, line.pd_page_sizes))} "
                                f"only on sglang {line.name}, not {page_size}")
    for flag, attr in (
        ("--enable-dp-attention", "enable_dp_attention"),
        ("--disaggregation-decode-enable-radix-cache", "disaggregation_decode_enable_radix_cache"),
        ("--disaggregation-decode-enable-offload-kvcache", "disaggregation_decode_enable_offload_kvcache"),
        ("--enable-hisparse", "enable_hisparse"),
    ):
        if getattr(server_args, attr, False):
            raise CanaryConfigError(f"{head} does not verify {flag} yet: drop {flag} or use {FLAG_MODE} none")
    spec = getattr(server_args, "speculative_algorithm", None)
    if spec not in (None, "", "NONE"):
        raise CanaryConfigError(
            f"{head} does not verify --speculative-algorithm {spec} yet: drop it or use {FLAG_MODE} none"
        )
    # The transferred records' hashes must mean the same on both sides: only the default hash settings travel.
    if config.real_data.value != "partial":
        raise CanaryConfigError(
            f"{head} is verified with --kv-canary-real-data partial only, not {config.real_data.value}: the "
            "prefill's records must hash what the decode side hashes"
        )
    for name, value, default in (("SGLANG_KV_CANARY_KV_HASH_BYTES", config.kv_hash_bytes, 16),
                                 ("SGLANG_KV_CANARY_KV_HASH_LAYERS", config.kv_hash_layers, (0,)),
                                 ("SGLANG_KV_CANARY_SCRUB_SLOTS_PER_FORWARD", config.scrub_slots_per_forward, 0)):
        if value != default:
            raise CanaryConfigError(
                f"{head} is verified with the default {name} only: the prefill's records must hash what the "
                f"decode side hashes; unset {name}"
            )
    # sglang 0.5.23: an unset retraction backup resolves to host_pool on a decode server, which the canary does not
    # follow (the KV comes back from a HiCache host pool without its records); cpu_tensor carries them
    backup = getattr(server_args, "disaggregation_decode_retraction_backup", "absent")
    if mode == "decode" and backup not in ("absent", "cpu_tensor", "none"):
        raise CanaryConfigError(
            f"{head} is verified with --disaggregation-decode-retraction-backup cpu_tensor or none, not "
            f"{backup or 'unset (host_pool on a decode server)'}: pass --disaggregation-decode-retraction-backup "
            "cpu_tensor"
        )
    staging = str(environ.get("SGLANG_DISAGG_STAGING_BUFFER", "")).strip().lower()
    if staging in ("1", "true", "yes", "on"):
        raise CanaryConfigError(
            f"{head} does not verify SGLANG_DISAGG_STAGING_BUFFER={environ['SGLANG_DISAGG_STAGING_BUFFER']} "
            "(the staging path copies K/V buffers only): unset it or use --kv-canary none"
        )


def _manager_of_scheduler(scheduler: Any):
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None or getattr(runner, "is_draft_worker", False):
        return None
    slot = getattr(runner, "canary_manager", None)
    return getattr(slot, "kv_canary_manager", slot)  # 0.5.23: the plugin's manager behind an InTreeSlot


def _req_row(req) -> int:
    """The request's req_to_token row, as the running line keeps it (0.5.23: ``req.kv.req_pool_idx``)."""
    from .lines import current_line

    return int(current_line().req_row(req))


# ---------------------------------------------------------------- both sides: the buffer list


def around_init_kv_manager(original, queue, *args, **kwargs):
    """Build the PD KV manager with the canary's records + origin registered after the KV buffers."""
    manager = _manager_of_scheduler(getattr(queue, "scheduler", None))
    if manager is None or manager.transfer is None:
        return original(queue, *args, **kwargs)
    pool = queue.token_to_kv_pool
    if len(manager.groups) != 1:
        raise CanaryConfigError(
            f"{FLAG_MODE} with --disaggregation-mode supports one-group KV pools only; "
            f"{type(pool).__name__} has {len(manager.groups)}"
        )
    page_size = int(getattr(pool, "page_size", 1))
    extra = extra_buf_infos(manager.groups[0].records, manager.transfer.origin, page_size)
    kv_infos = pool.get_contiguous_buf_infos
    pool.get_contiguous_buf_infos = lambda: splice(kv_infos(), extra)
    try:
        kv_manager = original(queue, *args, **kwargs)
    finally:
        del pool.get_contiguous_buf_infos  # back to the class method
    kv_manager.kv_canary_origin = (manager.transfer.origin, page_size)
    logger.info(
        "kv_canary_pd=%s transfer_buffers=%d canary_buffers=2 records_item_bytes=%d origin_item_bytes=%d",
        manager.transfer.mode, len(kv_manager.kv_args.kv_data_ptrs), extra[2][0], extra[2][1],
    )
    return kv_manager


_mismatch_logged = set()


def around_send_kvcache(original, kv_manager, session_id, prefill_kv_indices, dst_kv_ptrs, *args, **kwargs):
    """Prefill side: both sides must register the same buffer list, or the engine pairs wrong buffers."""
    ours = len(kv_manager.kv_args.kv_data_ptrs)
    if len(dst_kv_ptrs) != ours:
        if session_id not in _mismatch_logged:
            _mismatch_logged.add(session_id)
            logger.error(
                "kv_canary_pd_mismatch=1 session=%s prefill_buffers=%d decode_buffers=%d: run the prefill and the "
                "decode server with the kv_canary plugin and the same %s on/off (log/raise on both, or none on "
                "both); refusing this KV transfer",
                session_id, ours, len(dst_kv_ptrs), FLAG_MODE,
            )
        return -1
    return original(kv_manager, session_id, prefill_kv_indices, dst_kv_ptrs, *args, **kwargs)


def around_send_kvcache_slice(original, kv_manager, *args, **kwargs):
    """Heterogeneous-TP transfers slice K/V by head: the canary's records cannot be sliced."""
    if getattr(kv_manager, "kv_canary_origin", None) is not None:
        logger.error(
            "kv_canary_pd_mismatch=1 reason=heterogeneous_tp: %s with --disaggregation-mode needs the same "
            "attention TP size on both sides; refusing this KV transfer", FLAG_MODE,
        )
        return -1
    return original(kv_manager, *args, **kwargs)


def before_sender_send(sender, kv_indices, *args, **kwargs) -> None:
    """Prefill side: stamp (bootstrap room, slot) on the pages about to travel.

    0.5.23 on a GPU may pass page indices still being copied to the host, with the event that completes the copy
    (``indices_event``; sglang's transfer worker waits on it): wait for it before reading them.
    """
    stamp = getattr(getattr(sender, "kv_mgr", None), "kv_canary_origin", None)
    if stamp is None or kv_indices is None or len(kv_indices) == 0:
        return None
    event = kwargs.get("indices_event")
    if event is not None:
        event.synchronize()
    origin, page_size = stamp
    mark_sent(origin, [int(x) for x in kv_indices], page_size, int(sender.bootstrap_room or 0))
    return None


# ---------------------------------------------------------------- decode side: arrival


def after_get_new_prebuilt_batch(batch, scheduler, *args, **kwargs) -> None:
    """Decode side: the prebuilt batch's requests have their KV (no forward fills it: PREBUILT runs none).

    Positions [0, len(origin_input_ids) + len(output_ids) - 1) are in the pool: by
    transfer for a fresh request (one output id, the prefill's first token), or
    reloaded from the host for a resumed retracted one (more output ids). The
    first decode forward's HEAD verifies all of them; its TAIL continues the chain.
    """
    manager = _manager_of_scheduler(scheduler)
    if batch is None or manager is None or not manager.init_finished:
        return None
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    for req in batch.reqs:
        row, rid = _req_row(req), str(req.rid)
        prompt, outputs = list(recorded_prompt(req)), list(req.output_ids)  # overrides: the prefill's marker
        if getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:  # sglang's warmup / health check
            manager.note_fake_arrival(row, rid, prompt, outputs)
        elif len(outputs) == 1 and manager.transfer is not None:
            arrival = Arrival(rid=rid, room=int(req.bootstrap_room or 0), row=row, received=len(prompt))
            manager.note_transfer_arrival(arrival, prompt, outputs)
        else:
            manager.note_request_tokens(row, rid, prompt, outputs)
    return None


def note_extend_rooms(manager, reqs) -> None:
    """Prefill side: remember each admitted request's bootstrap room (reports name it)."""
    if manager.transfer is None or reqs is None:
        return
    for req in reqs:
        manager.transfer.note_room(str(req.rid), getattr(req, "bootstrap_room", None))


# ---------------------------------------------------------------- decode side: retraction


def _groups_of_allocator(allocator):
    get = getattr(allocator, "get_kvcache", None)
    pool = get() if get is not None else None
    return getattr(pool, "kv_canary_groups", None)


def _committed_slots(req, req_to_token_pool):
    return req_to_token_pool.req_to_token[_req_row(req), : req.seqlen - 1]


def after_offload_kv_cache(_result, req, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs) -> None:
    """Retraction on the decode side copies the KV to the host: copy the records with it."""
    groups = _groups_of_allocator(token_to_kv_pool_allocator)
    if groups:
        slots = _committed_slots(req, req_to_token_pool).long().to(groups[0].records.device)
        req.kv_canary_records_cpu = [g.records[slots].cpu() for g in groups]
    return None


def around_load_kv_cache(original, req, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs):
    """Resuming a retracted request reloads its KV into new slots: reload the records into the same slots."""
    saved = getattr(req, "kv_canary_records_cpu", None)
    result = original(req, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs)
    groups = _groups_of_allocator(token_to_kv_pool_allocator)
    if saved is not None and groups:
        slots = _committed_slots(req, req_to_token_pool).long()
        for g, rec in zip(groups, saved):
            g.records[slots.to(g.records.device)] = rec.to(g.records.device)
        del req.kv_canary_records_cpu
    return result
