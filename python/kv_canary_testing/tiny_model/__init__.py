"""External sglang model package for tests (``SGLANG_EXTERNAL_MODEL_PACKAGE=kv_canary_testing.tiny_model``).

sglang's registry imports every module of this package and collects ``EntryClass``.
"""

from kv_canary_testing import hicache_cpu, pd_cpu

hicache_cpu.install_if_enabled()  # HiCache on CPU, test-only (KVC_TEST_HICACHE_CPU=1 from the e2e fixture)
pd_cpu.install_if_enabled()  # PD on CPU (0.5.23), test-only (KVC_TEST_PD_CPU=1 from the PD fixture)
