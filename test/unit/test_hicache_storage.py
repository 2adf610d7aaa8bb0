"""HiCache storage tier: the records trailer (``storage_trailer``) and adapter/hicache_storage's page set/get bodies
against sglang 0.5.12's real ``HiCacheFile`` in a tmp dir and its host pool's page methods (layer_first) on a plain
buffer: records travel with the page, a page without a (valid) trailer reads as a miss, an existing key is not
rewritten, the storage_page flip lands in the stored K/V bytes where the perturb line says."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kv_canary.fingerprint import RECORD_WIDTH
from kv_canary.host_records import HostRecordStore
from kv_canary.perturb.storage_page import STORAGE_FLIP_MASK, PageGeometry
from kv_canary.runner.storage_pages import StoragePages
from kv_canary.storage_trailer import (BadTrailer, append_trailer, decode_trailer, encode_trailer,
                                       page_byte_offset, records_tag, split_page, trailer_nbytes)

LAYERS, PAGE, HEADS, DIM, SLOTS = 3, 4, 2, 4, 32


def _records(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 62), 1 << 62, (n, RECORD_WIDTH), generator=g, dtype=torch.int64)


# ------------------------------------------------------------------ trailer


def test_trailer_round_trip_and_size():
    recs = _records(PAGE)
    t = encode_trailer(recs)
    assert t.dtype == torch.uint8 and t.numel() == trailer_nbytes(PAGE) == 24 + PAGE * RECORD_WIDTH * 8 + 8
    assert bytes(t[:4].tolist()) == b"KVC1"
    assert torch.equal(decode_trailer(t, PAGE), recs)
    kv = torch.randn(2, LAYERS, PAGE, HEADS, DIM)
    value = append_trailer(kv.flatten(), recs)
    kv_bytes, got = split_page(value, kv.numel() * 4, PAGE)
    assert torch.equal(kv_bytes.view(torch.float32), kv.flatten()) and torch.equal(got, recs)


@pytest.mark.parametrize("cut", [0, 1, 17, trailer_nbytes(PAGE) - 1])
def test_short_trailer(cut):
    with pytest.raises(BadTrailer) as e:
        decode_trailer(encode_trailer(_records(PAGE))[:cut], PAGE)
    assert e.value.reason == "short"


def test_bad_magic_shape_and_every_flipped_trailer_byte():
    t = encode_trailer(_records(PAGE))
    bad = t.clone()
    bad[0] ^= 1
    with pytest.raises(BadTrailer, match="magic"):
        decode_trailer(bad, PAGE)
    with pytest.raises(BadTrailer) as e:
        decode_trailer(t[:trailer_nbytes(PAGE - 1)], PAGE - 1)  # read as another page size
    assert e.value.reason == "shape"
    for i in range(4, t.numel()):  # any flip past the magic: shape or mix, never decoded records
        bad = t.clone()
        bad[i] ^= 0x40
        with pytest.raises(BadTrailer) as e:
            decode_trailer(bad, PAGE)
        assert e.value.reason in ("shape", "mix"), (i, e.value.reason)


def test_records_hashed_another_way_read_as_no_records():
    """A valid trailer written by a server whose hashes cover other bytes (another KV_HASH window): no records for
    this reader (a miss), never compared."""
    a, b = records_tag([0, 0, 4]), records_tag([0, 0, 8])
    assert a != b and a == records_tag([0, 0, 4])
    recs = _records(PAGE)
    assert torch.equal(decode_trailer(encode_trailer(recs, a), PAGE, a), recs)
    with pytest.raises(BadTrailer) as e:
        decode_trailer(encode_trailer(recs, a), PAGE, b)
    assert e.value.reason == "tag"


def test_page_offset_matches_the_flat_layer_first_page():
    kv = torch.zeros(2, LAYERS, PAGE, HEADS * DIM * 4, dtype=torch.uint8)
    kv[1, 2, 3, 5] = 1
    off = page_byte_offset(half=1, layer=2, page_slot=3, byte=5, num_layers=LAYERS, page_size=PAGE,
                           row_bytes=HEADS * DIM * 4)
    assert int(kv.flatten().nonzero()) == off
    with pytest.raises(ValueError):
        page_byte_offset(half=0, layer=LAYERS, page_slot=0, byte=0, num_layers=LAYERS, page_size=PAGE, row_bytes=8)


# ------------------------------------------------------------------ page set/get on sglang's HiCacheFile

hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
from kv_canary.adapter import hicache_storage  # noqa: E402  (after sglang: the adapter is sglang-facing)


class FakeHost(SimpleNamespace):
    """sglang 0.5.12's ``MHATokenToKVPoolHost`` page methods for layer_first (``memory_pool_host.py:621-653``, whose
    module needs sgl_kernel's CUDA build to import) on a plain CPU buffer [2, layers, slots, heads, head_dim]."""

    def get_data_page(self, index, flat=True):
        page = self.kv_buffer[:, :, index:index + self.page_size, :, :]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[:, :, index:index + self.page_size, :, :] = data_page.reshape(
            2, self.layer_num, self.page_size, self.head_num, self.head_dim)


class Manager(StoragePages):
    """The StoragePages mixin with what it reads of a CanaryManager."""

    def __init__(self, flip_prob=0.0):
        self.host_records = HostRecordStore(SLOTS)
        self.config = SimpleNamespace(perturb_storage_page_prob=flip_prob)
        self.forwards = 100
        self.flips = []
        self.perturb = SimpleNamespace(perturb_storage_page=self._flip)
        self._init_storage_pages()
        self.storage_on = True

    def _flip(self, *, forward_index, key, geometry, xor_at):
        off = page_byte_offset(half=1, layer=1, page_slot=2, byte=3, num_layers=geometry.num_layers,
                               page_size=geometry.page_size, row_bytes=geometry.row_bytes)
        xor_at(off, STORAGE_FLIP_MASK)
        self.flips.append((key, off))
        return 2


def _host():
    kv = torch.randn(2, LAYERS, SLOTS, HEADS, DIM)
    return FakeHost(layout="layer_first", kv_buffer=kv, page_size=PAGE, layer_num=LAYERS, head_num=HEADS,
                    head_dim=DIM)


def _backend(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    cfg = hs.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="tiny")
    return hs.HiCacheFile(cfg)


class Op:
    def __init__(self, stop_after=None):
        self.request_id, self.completed_tokens, self._stop = "r", 0, stop_after

    def increment(self, n):
        if self._stop is not None and self.completed_tokens >= self._stop:
            return False
        self.completed_tokens += n
        return True


def _controller(tmp_path, monkeypatch, manager, host=None):
    return SimpleNamespace(storage_backend=_backend(tmp_path, monkeypatch), mem_pool_host=host or _host(),
                           page_size=PAGE, kv_canary_manager=manager)


def _unexpected(*args, **kwargs):
    raise AssertionError("sglang's own body ran with the canary on")


def test_set_then_get_carries_kv_and_records_to_other_host_slots(tmp_path, monkeypatch):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    src = torch.arange(0, 2 * PAGE)  # two pages, host slots 0..7
    m.host_records.put(src, _records(2 * PAGE, seed=1))
    assert hicache_storage.around_generic_page_set(_unexpected, c, ["k0", "k1"], src) is True
    assert m.storage_stats.pages_set == 2 and m.storage_stats.pages_existing == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(p.stat().st_size == 2 * LAYERS * PAGE * HEADS * DIM * 4 + trailer_nbytes(PAGE)
                                   for p in tmp_path.iterdir())
    dst = torch.arange(16, 16 + 2 * PAGE)
    op = Op()
    hicache_storage.around_generic_page_get(_unexpected, c, op, ["k0", "k1"], dst)
    assert op.completed_tokens == 2 * PAGE and m.storage_stats.pages_got == 2
    kv = c.mem_pool_host.kv_buffer
    assert torch.equal(kv[:, :, 16:24], kv[:, :, 0:8])
    assert torch.equal(m.host_records.records[16:24], m.host_records.records[0:8])
    assert m.storage_identity(16 + PAGE + 1) == (("storage_key", "k1"), ("storage_page_slot", 1))
    m._storage_slots_freed([16 + PAGE + 1])
    assert m.storage_identity(16 + PAGE + 1) == ()


def test_an_existing_key_is_not_rewritten_and_counted(tmp_path, monkeypatch):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    src = torch.arange(0, PAGE)
    hicache_storage.around_generic_page_set(_unexpected, c, ["k0"], src)
    before = (tmp_path / next(p.name for p in tmp_path.iterdir())).read_bytes()
    m.host_records.put(src, _records(PAGE, seed=5))  # other records now: the stored page must stay as it was
    assert hicache_storage.around_generic_page_set(_unexpected, c, ["k0"], src) is True
    assert m.storage_stats.pages_set == 1 and m.storage_stats.pages_existing == 1
    assert (tmp_path / next(p.name for p in tmp_path.iterdir())).read_bytes() == before


def test_a_page_stored_without_a_trailer_reads_as_a_miss_not_a_crash(tmp_path, monkeypatch):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    host = c.mem_pool_host
    # sglang's own set (canary-less writer) for k1; the canary's for k0
    hicache_storage.around_generic_page_set(_unexpected, c, ["k0"], torch.arange(0, PAGE))
    c.storage_backend.batch_set(["k1"], [host.get_data_page(PAGE)])
    op = Op()
    before = host.kv_buffer[:, :, 16 + PAGE:].clone()
    hicache_storage.around_generic_page_get(_unexpected, c, op, ["k0", "k1"], torch.arange(16, 16 + 2 * PAGE))
    assert op.completed_tokens == PAGE  # the prefetch ends at the page without records
    assert m.storage_stats.pages_got == 1 and m.storage_stats.pages_without_records == 1
    assert torch.equal(host.kv_buffer[:, :, 16 + PAGE:], before)  # nothing of it written to the host pool
    assert not m.host_records.records[16 + PAGE:].any()


def test_a_page_another_servers_hashes_wrote_is_a_miss(tmp_path, monkeypatch):
    writer, reader = Manager(), Manager()
    writer.storage_tag, reader.storage_tag = records_tag([0, 0, 4]), records_tag([0, 0, 8])
    c = _controller(tmp_path, monkeypatch, writer)
    hicache_storage.around_generic_page_set(_unexpected, c, ["k0"], torch.arange(0, PAGE))
    c.kv_canary_manager = reader
    op = Op()
    hicache_storage.around_generic_page_get(_unexpected, c, op, ["k0"], torch.arange(16, 16 + PAGE))
    assert op.completed_tokens == 0 and reader.storage_stats.pages_without_records == 1


@pytest.mark.parametrize("where", ["magic", "mix"])
def test_a_corrupt_trailer_ends_the_prefetch_there(tmp_path, monkeypatch, where):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    hicache_storage.around_generic_page_set(_unexpected, c, ["k0"], torch.arange(0, PAGE))
    path = next(tmp_path.iterdir())
    data = bytearray(path.read_bytes())
    kv_nbytes = len(data) - trailer_nbytes(PAGE)
    data[kv_nbytes + (0 if where == "magic" else 40)] ^= 0x08
    path.write_bytes(bytes(data))
    op = Op()
    hicache_storage.around_generic_page_get(_unexpected, c, op, ["k0"], torch.arange(16, 16 + PAGE))
    assert op.completed_tokens == 0 and m.storage_stats.pages_without_records == 1


def test_a_missing_page_is_sglangs_plain_miss_and_termination_stops(tmp_path, monkeypatch):
    m = Manager()
    c = _controller(tmp_path, monkeypatch, m)
    hicache_storage.around_generic_page_set(_unexpected, c, ["k0", "k1"], torch.arange(0, 2 * PAGE))
    op = Op()
    hicache_storage.around_generic_page_get(_unexpected, c, op, ["k0", "nope", "k1"], torch.arange(8, 8 + 3 * PAGE))
    assert op.completed_tokens == PAGE and m.storage_stats.pages_without_records == 0
    op = Op(stop_after=0)  # terminated by the controller: the first page is read but not counted
    hicache_storage.around_generic_page_get(_unexpected, c, op, ["k0", "k1"], torch.arange(8, 8 + 2 * PAGE))
    assert op.completed_tokens == 0 and m.storage_stats.pages_got == 2


def test_no_canary_runs_sglangs_own_bodies(tmp_path, monkeypatch):
    c = _controller(tmp_path, monkeypatch, None)
    calls = []
    assert hicache_storage.around_generic_page_set(lambda *a: calls.append(a) or "own", c, ["k"], torch.arange(4)) \
        == "own"
    hicache_storage.around_generic_page_get(lambda *a: calls.append(a), c, Op(), ["k"], torch.arange(4))
    assert len(calls) == 2 and not list(tmp_path.iterdir())


def test_storage_flip_lands_in_the_stored_kv_and_is_tracked_to_the_load_back(tmp_path, monkeypatch):
    m = Manager(flip_prob=1.0)
    c = _controller(tmp_path, monkeypatch, m)
    host = c.mem_pool_host
    hicache_storage.around_generic_page_set(_unexpected, c, ["k0"], torch.arange(0, PAGE))
    assert m.flips and m.flips[0][0] == "k0"
    dst = torch.arange(16, 16 + PAGE)
    hicache_storage.around_generic_page_get(_unexpected, c, Op(), ["k0"], dst)
    diff = (host.kv_buffer[:, :, 16:16 + PAGE] != host.kv_buffer[:, :, 0:PAGE]).nonzero().tolist()
    assert [d[:3] for d in diff] == [[1, 1, 2]]  # V, layer 1, page slot 2: where the flip was placed
    a = host.kv_buffer[1, 1, 18].view(torch.uint8).flatten()
    b = host.kv_buffer[1, 1, 2].view(torch.uint8).flatten()
    assert (a ^ b).nonzero().flatten().tolist() == [3] and int(a[3] ^ b[3]) == STORAGE_FLIP_MASK
    assert torch.equal(m.host_records.records[16:16 + PAGE], m.host_records.records[0:PAGE])  # trailer intact
    assert m.storage_pages_stats()["hicache_flipped_storage_pages_loaded"] == 0
    m._storage_slots_loaded([17, 19])  # other slots of the page: their bytes are intact
    assert m.storage_pages_stats()["hicache_flipped_storage_pages_loaded"] == 0
    m._storage_slots_loaded([18])
    m._storage_slots_freed([18])  # a count of pages loaded back, ever: not undone by the host copy's free
    assert m.storage_pages_stats()["hicache_flipped_storage_pages_loaded"] == 1


def test_perturb_manager_places_the_storage_flip(tmp_path):
    """The real PerturbManager draw: page slot and row byte within the page geometry; logged with the key."""
    from kv_canary.perturb.storage_page import flip_stored_byte

    group = SimpleNamespace(rows=[SimpleNamespace(layer=l, half=h, row_words=HEADS * DIM) for l in range(LAYERS)
                                  for h in ("k", "v")], sources=[SimpleNamespace(layer=0, half="k", words=4)])
    geo = PageGeometry(num_layers=LAYERS, page_size=PAGE, row_bytes=HEADS * DIM * 4)
    seen = []
    for seed in range(50):
        slot, flip = flip_stored_byte(group, geo, random.Random(seed), "anywhere",
                                      lambda off, mask: seen.append((off, mask)))
        off = page_byte_offset(half=0 if flip.half == "k" else 1, layer=flip.layer, page_slot=slot, byte=flip.byte,
                               num_layers=LAYERS, page_size=PAGE, row_bytes=geo.row_bytes)
        assert seen[-1] == (off, STORAGE_FLIP_MASK) and flip.hashed == (flip.layer == 0 and flip.half == "k"
                                                                        and flip.byte < 16)
    assert len({s[0] for s in seen}) > 25  # spread over the page


def test_contain_poisons_keys_and_the_hit_query_stops_before_them():
    """Storage has no delete: after contain evicted a bad host copy, a lookup of its pages is a miss."""
    m = Manager()
    c = SimpleNamespace(kv_canary_manager=m, page_size=PAGE)
    hits = (["a", "b", "c"], 3 * PAGE)
    assert hicache_storage.after_storage_hit_query(hits, c, object()) == hits
    assert m.poison_storage_keys(["b", "x"]) == 2 and m.poison_storage_keys(["b"]) == 0
    assert hicache_storage.after_storage_hit_query(hits, c, object()) == (["a"], PAGE)
    assert hicache_storage.after_storage_hit_query((["x"], PAGE), c, object()) == ([], 0)
    stats = m.storage_pages_stats()
    assert stats["hicache_storage_keys_poisoned"] == 2 and stats["hicache_storage_hits_poisoned"] == 2
    c.kv_canary_manager = None
    assert hicache_storage.after_storage_hit_query(hits, c, object()) == hits


def test_contain_eviction_returns_the_subtree_storage_keys():
    from kv_canary.adapter.contain_hicache import evict_hicache_subtree

    class Tree:
        def _evict_regular(self, n):
            n.value = None

    child = SimpleNamespace(children={}, value=torch.arange(4), host_value=None, hash_value=["c0"])
    node = SimpleNamespace(children={"k": child}, value=None, host_value=None, hash_value=["p0", "p1"])
    removed = set()
    nodes, tokens, host_slots, keys = evict_hicache_subtree(Tree(), node, removed)
    assert (nodes, tokens, host_slots) == (2, 4, 0) and sorted(keys) == ["c0", "p0", "p1"]
