"""The adapter layer: the only code that knows sglang's batch and pool objects.

``batch_adapter`` translates a ``ForwardBatch`` (read by attribute, duck-typed)
into the plain ``ForwardView`` / ``HostBatch`` the runner works on; ``pools``
registers sglang's KV pool classes with the buffer-group builder.
"""
