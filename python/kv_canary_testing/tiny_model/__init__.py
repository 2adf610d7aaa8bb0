"""External sglang model package for tests (``SGLANG_EXTERNAL_MODEL_PACKAGE=kv_canary_testing.tiny_model``).

sglang's registry imports every module of this package and collects ``EntryClass``.
"""
