"""The 0.5.19 line (``v0_5_19``, a diff of 0.5.18): the store hook on ``RadixCache._insert_helper`` in place of the
``_record_store_event`` 0.5.19 lacks, 0.5.23's ``Req.kv`` reader, and a fence target only 0.5.19 has; no sglang
needed. Which releases it serves (0.5.19): ``test_release_fence``."""

from __future__ import annotations

from types import SimpleNamespace

from kv_canary.adapter.lines import v0_5_18, v0_5_19, v0_5_23
from kv_canary.adapter.policy_0_5_18 import POLICY_0_5_18
from kv_canary.adapter.policy_0_5_19 import _FROM_0_5_23, POLICY_0_5_19
from kv_canary.adapter.policy_0_5_23 import POLICY_0_5_23
from kv_canary.adapter.radix import INDEX_ATTR

_RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache."


def test_the_line_is_0_5_18s_with_the_store_hook_moved_and_the_kv_reader():
    line, base = v0_5_19.LINE, v0_5_18.LINE
    assert line.versions == ("0.5.19",) and line.untested_versions == ()
    assert set(line.hooks) ^ set(base.hooks) == {_RADIX + "_record_store_event", _RADIX + "_insert_helper",
                                                 "sglang.srt.mem_cache.events.KVCacheEventRecorder.record_store"}
    assert all(line.hooks[t] == hook for t, hook in base.hooks.items() if t in line.hooks)
    assert line.hooks[_RADIX + "_insert_helper"] == ("lines.v0_5_19.after_insert_helper", "after")
    assert line.req_row is v0_5_23.req_row and line.policy is POLICY_0_5_19
    assert line.req_row(SimpleNamespace(kv=SimpleNamespace(req_pool_idx=7))) == 7
    assert "sglang 0.5.19" in line.unported(SimpleNamespace(kv_canary="contain"))


class _Index:
    def __init__(self):
        self.added = []

    def add(self, slots, tokens, start, pred):
        self.added.append((list(slots), list(tokens), start, pred))


class _Key(list):
    @property
    def token_ids(self):
        return list(self)


def test_the_node_insert_helper_added_enters_the_index_and_a_full_match_adds_nothing():
    index = _Index()
    tree = SimpleNamespace(**{INDEX_ATTR: index})
    root = SimpleNamespace(parent=None, key=_Key(), value=[])
    head = SimpleNamespace(parent=root, key=_Key([1, 2]), value=[10, 11])
    new = SimpleNamespace(parent=head, key=_Key([3, 4, 5]), value=[12, 13, 14])
    v0_5_19.after_insert_helper((2, new), tree, root, _Key([1, 2, 3, 4, 5]), [10, 11, 12, 13, 14])
    assert index.added == [([12, 13, 14], [3, 4, 5], 2, [11])]  # after its parent's 2 positions, chained to slot 11
    v0_5_19.after_insert_helper((5, new), tree, root, _Key([1, 2, 3, 4, 5]), [10, 11, 12, 13, 14])  # all cached
    assert len(index.added) == 1
    v0_5_19.fence_only(None, object(), new)  # the fence's target: nothing happens
    assert len(index.added) == 1


def test_its_policy_is_0_5_18s_plus_the_fields_0_5_19_added_classified_as_on_0_5_23():
    rules, elsewhere, neutral = POLICY_0_5_19.classified()
    assert rules | elsewhere | neutral == set().union(*POLICY_0_5_18.classified()) | _FROM_0_5_23
    assert not (rules & neutral) and not (rules & elsewhere) and not (elsewhere & neutral)
    for field, rule in POLICY_0_5_19.rules.items():
        assert rule is (POLICY_0_5_23 if field in _FROM_0_5_23 else POLICY_0_5_18).rules[field]
