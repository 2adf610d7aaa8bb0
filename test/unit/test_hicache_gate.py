"""The HiCache startup gate (adapter/hicache.check_hicache): the verified combination passes, every other one
is refused naming the flag and its value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_canary.adapter.hicache import check_hicache, check_hicache_pool
from kv_canary.config import CanaryConfig, CanaryConfigError


def _args(**kw):
    base = dict(enable_hierarchical_cache=True, hicache_storage_backend=None, device="cpu", page_size=1,
                hicache_write_policy="write_through", hicache_mem_layout="layer_first", hicache_io_backend="kernel",
                tp_size=1,
                speculative_algorithm=None, disaggregation_mode="null", kv_canary_sweep_interval=0)
    base.update(kw)
    return SimpleNamespace(**base)


def _config(mode="raise", real_data="partial", sweep=0, environ=None, hicache=True):
    return CanaryConfig.build(mode=mode, real_data=real_data, sweep_interval=sweep, environ=environ or {},
                              hicache=hicache)


@pytest.mark.parametrize("kw", [{}, {"page_size": 16}, {"hicache_write_policy": "write_back"},
                                {"hicache_write_policy": "write_through_selective"}, {"page_size": None},
                                {"device": "cuda"}, {"device": "cuda", "hicache_io_backend": "direct"},
                                {"hicache_storage_backend": "file"},
                                {"hicache_storage_backend": "file", "page_size": 16},
                                {"hicache_mem_layout": "page_first"}])
def test_verified_combinations_pass(kw):
    check_hicache(_args(**kw), _config(), line="0.5.12")
    check_hicache(_args(**kw), _config("log"), line="0.5.12")
    check_hicache(_args(**kw), _config("contain"), line="0.5.12")  # evicts device and host copies (and poisons keys)


@pytest.mark.parametrize("kw", [{}, {"page_size": 16}, {"hicache_write_policy": "write_back"},
                                {"hicache_write_policy": "write_through_selective"}, {"hicache_io_backend": "direct"},
                                {"hicache_mem_layout": "page_first"}, {"device": "cuda"},
                                {"device": "cuda", "page_size": 16, "hicache_write_policy": "write_back"},
                                {"device": "cuda", "hicache_io_backend": "direct",
                                 "hicache_write_policy": "write_through_selective"},
                                {"hicache_storage_backend": "file"},
                                {"hicache_storage_backend": "file", "page_size": 16}])
def test_verified_combinations_pass_on_0_5_23(kw):
    """sglang 0.5.23: log and raise, on CPU (through the test shim) and on a GPU (layer_first there); the ``file``
    storage tier on CPU."""
    check_hicache(_args(**kw), _config(), line="0.5.23")
    check_hicache(_args(**kw), _config("log"), line="0.5.23")


CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


@pytest.mark.parametrize("kw", [{}, {"page_size": 16}, {"hicache_write_policy": "write_back"},
                                {"hicache_mem_layout": "page_first"}])
def test_contain_on_0_5_23_runs_on_the_python_tree_core_only(kw, monkeypatch):
    """sglang 0.5.23's Rust tree core (the default) has no per-node host drop: contain needs the Python core
    (``contain_hicache_0_5_23``); with the storage tier too (its keys poisoned)."""
    monkeypatch.setenv(CORE_ENV, "python")
    check_hicache(_args(**kw), _config("contain"), line="0.5.23")
    if "hicache_mem_layout" not in kw:  # storage: layer_first only
        check_hicache(_args(**{**kw, "hicache_storage_backend": "file"}), _config("contain"), line="0.5.23")
    check_hicache(_args(**{**kw, "device": "cuda"}), _config("contain"), line="0.5.23")  # and on a GPU
    for core in ("rust", ""):  # unset or empty: sglang's default, rust
        monkeypatch.setenv(CORE_ENV, core)
        with pytest.raises(CanaryConfigError) as e:
            check_hicache(_args(**kw), _config("contain"), line="0.5.23")
        assert f"contain on sglang 0.5.23 with {CORE_ENV}=rust" in str(e.value)
        assert f"set {CORE_ENV}=python" in str(e.value)
    monkeypatch.setenv(CORE_ENV, "rust")
    check_hicache(_args(**kw), _config("log"), line="0.5.23")  # log/raise: any core
    check_hicache(_args(**kw), _config("contain"), line="0.5.12")  # 0.5.12 has no tree core to choose


@pytest.mark.parametrize("kw,line,config,needle", [
    ({}, "0.5.17", {}, "sglang 0.5.17"),
    ({"hicache_storage_backend": "mooncake"}, "0.5.12", {}, "--hicache-storage-backend mooncake"),
    ({"hicache_storage_backend": "hf3fs"}, "0.5.12", {}, "--hicache-storage-backend hf3fs"),
    ({}, "0.5.23", {"mode": "contain"}, "--kv-canary contain on sglang 0.5.23"),
    ({"device": "npu"}, "0.5.23", {}, "--device npu"),
    ({"hicache_mem_layout": "page_first_direct"}, "0.5.23", {}, "--hicache-mem-layout page_first_direct"),
    ({"hicache_storage_backend": "file"}, "0.5.23", {"mode": "contain"}, "--kv-canary contain on sglang 0.5.23"),
    ({"hicache_storage_backend": "mooncake"}, "0.5.23", {}, "--hicache-storage-backend mooncake"),
    ({"hicache_mem_layout": "page_first", "hicache_storage_backend": "file"}, "0.5.23", {},
     "--hicache-mem-layout page_first"),
    ({"page_size": 64}, "0.5.23", {}, "--page-size 64"),
    ({"device": "npu"}, "0.5.12", {}, "--device npu"),
    ({"hicache_io_backend": "kernel_ascend"}, "0.5.12", {}, "--hicache-io-backend kernel_ascend"),
    ({"page_size": 64}, "0.5.12", {}, "--page-size 64"),
    ({"hicache_mem_layout": "page_first_direct"}, "0.5.12", {}, "--hicache-mem-layout page_first_direct"),
    ({"hicache_mem_layout": "page_first", "hicache_storage_backend": "file"}, "0.5.12", {},
     "--hicache-mem-layout page_first"),
    ({"hicache_mem_layout": "page_first", "device": "cuda"}, "0.5.12", {}, "--hicache-mem-layout page_first"),
    ({"tp_size": 2}, "0.5.12", {}, "--tp-size 2"),
    ({"speculative_algorithm": "EAGLE"}, "0.5.12", {}, "--speculative-algorithm EAGLE"),
    ({"disaggregation_mode": "decode"}, "0.5.12", {}, "--disaggregation-mode decode"),
    ({"kv_canary_sweep_interval": 8}, "0.5.12", {"sweep": 8}, "--kv-canary-sweep-interval 8"),
    ({}, "0.5.12", {"real_data": "all"}, "--kv-canary-real-data all"),
])
def test_unverified_combinations_are_refused_naming_the_flag(kw, line, config, needle, monkeypatch):
    monkeypatch.delenv(CORE_ENV, raising=False)  # sglang 0.5.23's default tree core (rust)
    with pytest.raises(CanaryConfigError) as e:
        check_hicache(_args(**kw), _config(**config), line=line)
    msg = str(e.value)
    assert needle in msg and "--enable-hierarchical-cache" in msg and "--kv-canary none" in msg
    if "hicache_mem_layout" in kw:  # the refusal says what to pass instead
        assert "use --hicache-mem-layout layer_first" in msg


def test_storage_without_hicache_is_refused_and_canary_off_is_never_checked():
    with pytest.raises(CanaryConfigError, match="--hicache-storage-backend file"):
        check_hicache(_args(enable_hierarchical_cache=False, hicache_storage_backend="file"), _config(),
                      line="0.5.12")
    check_hicache(_args(enable_hierarchical_cache=False), _config(), line="0.5.12")
    check_hicache(_args(device="cuda", tp_size=4), CanaryConfig.build(mode="none", environ={}), line="0.5.23")


STORAGE_FLIP = {"SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB": "0.5"}


def test_storage_page_perturbation_needs_file_storage():
    check_hicache(_args(hicache_storage_backend="file"), _config("log", environ=STORAGE_FLIP), line="0.5.12")
    check_hicache(_args(hicache_storage_backend="file"), _config("log", environ=STORAGE_FLIP), line="0.5.23")
    with pytest.raises(CanaryConfigError, match="--hicache-storage-backend is unset"):
        check_hicache(_args(), _config("log", environ=STORAGE_FLIP), line="0.5.12")
    with pytest.raises(CanaryConfigError, match="PERTURB_STORAGE_PAGE_PROB.*--enable-hierarchical-cache"):
        _config("log", environ=STORAGE_FLIP, hicache=False)
    with pytest.raises(CanaryConfigError, match="PERTURB_STORAGE_PAGE_PROB"):
        _config("log", environ={"SGLANG_KV_CANARY_PERTURB_STORAGE_PAGE_PROB": "2"})


def test_pool_gate():
    check_hicache_pool("MHATokenToKVPool", ["full"])
    for pool, groups in (("MLATokenToKVPool", ["full"]), ("SWAKVPool", ["full", "swa"])):
        with pytest.raises(CanaryConfigError, match=pool):
            check_hicache_pool(pool, groups)


def test_host_scrub_needs_hicache():
    scrub = {"SGLANG_KV_CANARY_HOST_SCRUB_SLOTS_PER_SECOND": "1024"}
    check_hicache(_args(), _config("raise", environ=scrub), line="0.5.12")
    check_hicache(_args(), _config("contain", environ=scrub), line="0.5.12")  # evicts a copy found at rest
    check_hicache(_args(hicache_storage_backend="file"), _config("log", environ=scrub), line="0.5.12")
    with pytest.raises(CanaryConfigError, match="HOST_SCRUB_SLOTS_PER_SECOND checks HiCache's host copies"):
        _config("raise", environ=scrub, hicache=False)
