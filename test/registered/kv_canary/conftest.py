"""Fixtures of the kv-canary e2e suite: skip the CUDA flavour where there is no GPU."""

import pytest

from kv_canary_testing.canary_e2e import cuda_skip_reason, e2e_device


@pytest.fixture(scope="session", autouse=True)
def _device_available():
    if e2e_device() == "cuda":
        reason = cuda_skip_reason()
        if reason:
            pytest.skip(f"KVC_TEST_DEVICE=cuda: {reason}")
