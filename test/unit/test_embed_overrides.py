"""Positional embedding overrides (``adapter/embed_overrides``): the marker token in the request's record and in the
ids its TAIL checks, at the positions the forward feeds. The server-level check is #27472's real bug
(test_e2e_real_bugs_0523.py, by hand): the reader of a cached override slot is reported."""

from types import SimpleNamespace

import torch

from kv_canary.adapter.embed_overrides import EMBED_OVERRIDE_TOKEN, fed_positions, marked_ids, recorded_prompt

M = EMBED_OVERRIDE_TOKEN


def req(ids, positions=None):
    return SimpleNamespace(origin_input_ids=ids,
                           positional_embed_overrides=None if positions is None else SimpleNamespace(positions=positions))


def test_the_record_holds_the_marker_at_override_positions():
    plain = req([5, 6, 7, 8])
    assert recorded_prompt(plain) is plain.origin_input_ids
    assert list(recorded_prompt(req([5, 6, 7, 8], [1, 3, 9]))) == [5, M, 7, M]


def test_the_fed_ids_hold_the_marker_at_the_positions_this_forward_feeds():
    # two requests: A (prefix 2, 3 new: positions 2..4, overrides at 1 (cached) and 3), B (plain, 2 new)
    ids = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int32)
    flat = fed_positions([req(list(range(5)), [1, 3]), req([0, 1])], [2, 0], [3, 2])
    assert flat == [1]
    out = marked_ids(ids, flat)
    assert out.dtype == torch.int32 and out.tolist() == [10, M, 12, 20, 21]
    assert ids.tolist() == [10, 11, 12, 20, 21]  # a copy: sglang's tensor is not touched
    assert marked_ids(ids, []) is ids  # no override: no copy
    assert fed_positions([req(list(range(5)), [0])], [2], [3]) == []  # only in the cached prefix
