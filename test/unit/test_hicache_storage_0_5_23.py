"""HiCache's storage tier on sglang 0.5.23 (adapter/hicache_0_5_23): the page set/get hooks run the shared bodies
against 0.5.23's real ``HiCacheFile`` (temp file + ``os.replace``, its LRU evictor) through the controller's
``storage_host_pool``, with 0.5.23's contract: ``_generic_page_get`` returns the pages read and reads none after
the operation is terminated. The page methods are test_hicache_storage's layer_first ``FakeHost`` (0.5.23's
``MHATokenToKVPoolHost`` has the same ones, ``pool_host/mha.py``)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from test_hicache_storage import PAGE, Manager, _backend, _host, _records, _unexpected

cc = pytest.importorskip("sglang.srt.managers.cache_controller")
from kv_canary.adapter import hicache_0_5_23 as h23  # noqa: E402  (after sglang: the adapter is sglang-facing)
from kv_canary.adapter.lines import v0_5_23  # noqa: E402


class Op:
    """0.5.23's ``PrefetchOperation`` as the page get reads it: terminated after ``stop_after`` checks."""

    def __init__(self, stop_after=None):
        self.request_id, self.checks, self._stop = "r", 0, stop_after

    def is_terminated(self):
        self.checks += 1
        return self._stop is not None and self.checks > self._stop


class NoGroup:
    """0.5.23's ``mem_pool_host`` is a ``HostPoolGroup``: the storage hooks must read ``storage_host_pool``."""

    def __getattr__(self, name):
        raise AssertionError(f"the storage hook read mem_pool_host.{name}")


def _controller(tmp_path, monkeypatch, manager):
    return SimpleNamespace(storage_backend=_backend(tmp_path, monkeypatch), storage_host_pool=_host(),
                           mem_pool_host=NoGroup(), page_size=PAGE, kv_canary_manager=manager)


def test_the_hooks_match_sglangs_page_get_set_and_are_in_the_line_table():
    for name, hook in (("_generic_page_set", h23.around_generic_page_set),
                       ("_generic_page_get", h23.around_generic_page_get)):
        ours = list(inspect.signature(hook).parameters)[2:]  # after (original, controller)
        assert ours == list(inspect.signature(getattr(cc.HiCacheController, name)).parameters)[1:]
        target = f"sglang.srt.managers.cache_controller.HiCacheController.{name}"
        assert v0_5_23.HICACHE_HOOKS[target] == (f"hicache_0_5_23.around{name}", "around")
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    # the hybrid controller inherits both, so the hooks on the base class are the ones it runs
    assert "_generic_page_get" not in vars(HybridCacheController)
    assert "_generic_page_set" not in vars(HybridCacheController)


def test_set_then_get_returns_the_pages_read_with_their_records(tmp_path, monkeypatch):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    src = torch.arange(0, 2 * PAGE)
    m.host_records.put(src, _records(2 * PAGE, seed=3))
    assert h23.around_generic_page_set(_unexpected, c, ["k0", "k1"], src) is True
    assert m.storage_stats.pages_set == 2 and not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    dst = torch.arange(16, 16 + 2 * PAGE)
    assert h23.around_generic_page_get(_unexpected, c, Op(), ["k0", "k1"], dst) == 2
    kv = c.storage_host_pool.kv_buffer
    assert torch.equal(kv[:, :, 16:24], kv[:, :, 0:8])
    assert torch.equal(m.host_records.records[16:24], m.host_records.records[0:8])
    assert m.storage_stats.pages_got == 2


def test_a_terminated_operation_reads_no_further_page(tmp_path, monkeypatch):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    h23.around_generic_page_set(_unexpected, c, ["k0", "k1"], torch.arange(0, 2 * PAGE))
    assert h23.around_generic_page_get(_unexpected, c, Op(stop_after=0), ["k0", "k1"], torch.arange(16, 24)) == 0
    assert m.storage_stats.pages_got == 0 and not m.host_records.records[16:24].any()
    assert h23.around_generic_page_get(_unexpected, c, Op(stop_after=1), ["k0", "k1"], torch.arange(16, 24)) == 1
    assert m.storage_stats.pages_got == 1 and not m.host_records.records[16 + PAGE:24].any()


def test_a_miss_or_a_page_without_records_ends_the_count_there(tmp_path, monkeypatch):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    h23.around_generic_page_set(_unexpected, c, ["k0"], torch.arange(0, PAGE))
    c.storage_backend.batch_set(["k2"], [c.storage_host_pool.get_data_page(PAGE)])  # sglang's own: no trailer
    assert h23.around_generic_page_get(_unexpected, c, Op(), ["k0", "nope", "k0"], torch.arange(8, 20)) == 1
    assert h23.around_generic_page_get(_unexpected, c, Op(), ["k0", "k2"], torch.arange(8, 16)) == 1
    assert m.storage_stats.pages_without_records == 1


def test_no_canary_runs_sglangs_own_bodies_and_returns_theirs(tmp_path, monkeypatch):
    c = _controller(tmp_path, monkeypatch, None)
    calls = []
    assert h23.around_generic_page_set(lambda *a: calls.append(a) or True, c, ["k"], torch.arange(4)) is True
    assert h23.around_generic_page_get(lambda *a: calls.append(a) or 7, c, Op(), ["k"], torch.arange(4)) == 7
    assert len(calls) == 2 and not list(tmp_path.iterdir())


def test_a_flip_lands_in_the_file_os_replace_wrote(tmp_path, monkeypatch):
    """The perturbation XORs the stored page in place after 0.5.23's ``set`` replaced it: read back, the flipped
    byte differs from the host copy written, the trailer's records do not."""
    m = Manager(flip_prob=1.0)
    c = _controller(tmp_path, monkeypatch, m)
    h23.around_generic_page_set(_unexpected, c, ["k0"], torch.arange(0, PAGE))
    assert m.flips and m.flips[0][0] == "k0"
    assert h23.around_generic_page_get(_unexpected, c, Op(), ["k0"], torch.arange(16, 16 + PAGE)) == 1
    kv = c.storage_host_pool.kv_buffer
    diff = (kv[:, :, 16:16 + PAGE] != kv[:, :, 0:PAGE]).nonzero().tolist()
    assert [d[:3] for d in diff] == [[1, 1, 2]]
    assert torch.equal(m.host_records.records[16:16 + PAGE], m.host_records.records[0:PAGE])
