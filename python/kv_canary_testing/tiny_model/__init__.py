"""External sglang model package for tests (``SGLANG_EXTERNAL_MODEL_PACKAGE=kv_canary_testing.tiny_model``).

sglang's registry imports every module of this package and collects ``EntryClass``.
"""

from kv_canary_testing.hicache_cpu import install_if_enabled

install_if_enabled()  # HiCache on CPU, test-only (KVC_TEST_HICACHE_CPU=1 from the e2e fixture)
