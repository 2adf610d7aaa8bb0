"""What sglang 0.5.23's call sites for its in-tree canary call (``model_runner.canary_manager``): ``InTreeSlot``.

The 0.5.23 line's ``install`` (``lines.v0_5_23``) returns one for the target runner, ``spec_0_5_23``'s
``DraftInTreeSlot`` (a subclass) for the draft runner; both import it from here.
"""

from __future__ import annotations


class InTreeSlot:
    """What sglang 0.5.23's call sites for its in-tree canary call (``model_runner.canary_manager``), served by the
    plugin's ``CanaryManager`` (``kv_canary_manager``)."""

    def __init__(self, manager, model_runner=None):
        self.kv_canary_manager = manager
        self._model_runner = model_runner  # HiCache: its KV pool's layer counter names the load a forward consumes

    def with_ops_outside_graph(self, *, single_forward_indices, maybe_inaccurate_forward_batch):
        if self._model_runner is not None and getattr(self.kv_canary_manager, "host_records", None) is not None:
            from .hicache import note_load_consumer  # sglang set the consumer index before this forward

            note_load_consumer(self.kv_canary_manager, self._model_runner)
        return self.kv_canary_manager.with_ops_outside_graph(
            single_forward_indices=single_forward_indices, maybe_inaccurate_forward_batch=maybe_inaccurate_forward_batch)

    def with_active_single_forward_manager(self, index: int):
        return self.kv_canary_manager.with_active_single_forward_manager(index)

    def mark_init_finished(self) -> None:
        """Called by sglang right after graph capture; the plugin marks at the end of ``Scheduler.init_model_worker``
        instead (``after_init_model_worker``), after sampling prewarm and post-capture KV sizing too."""

    def attach_radix_cache(self, tree_cache) -> None:
        """The plugin attaches the tree with metrics and contain in its ``Scheduler.__init__`` hook (right after
        this call), through the line's reader (``unified_radix``)."""

    def per_forward_workspace_bytes(self) -> int:
        """Bytes the canary allocates per forward after install, for sglang's post-capture KV sizing: none (every
        buffer is preallocated at install)."""
        return 0
