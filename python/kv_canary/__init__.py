"""kv-canary: a KV-cache integrity monitor plugin for sglang 0.5.12."""

__version__ = "0.1.0"
