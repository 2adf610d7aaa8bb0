"""Positional embedding overrides (sglang's ``Req.positional_embed_overrides``, e.g. ``/v1/score``'s
``query_embed_overrides``): at those positions the model is fed a caller's vector in place of the placeholder
token's embedding, so the KV there is not determined by the token id.

The canary records such a slot under ``EMBED_OVERRIDE_TOKEN``, a token no vocabulary has, in the request's record
(the token oracle) and in the ids its TAIL checks the forward's fed tokens against. The request's own later reads
agree (its chain runs over the same marker); another request that reaches those slots with the plain placeholder
ids (a radix hit, as sglang's #27472 made) fails the chain check at its read: ``token``. Every override of a request
gets the same marker: two requests with the same ids and different vectors are not told apart.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

EMBED_OVERRIDE_TOKEN = (1 << 30) + 1  # int32-safe, above any vocabulary, not the oracle's UNKNOWN (-1)


def override_positions(req) -> Sequence[int]:
    """The request's override positions (absolute in its sequence); () for a plain request."""
    overrides = getattr(req, "positional_embed_overrides", None)
    return () if overrides is None else overrides.positions


def recorded_prompt(req) -> Sequence[int]:
    """The request's prompt ids as the canary records them: the marker at each override position."""
    ids = req.origin_input_ids
    positions = override_positions(req)
    if not positions:
        return ids
    marked = list(ids)
    for p in positions:
        if 0 <= p < len(marked):
            marked[p] = EMBED_OVERRIDE_TOKEN
    return marked


def fed_positions(reqs: Sequence, prefix_lens: Sequence[int], new_lens: Sequence[int]) -> List[int]:
    """The override positions an extend forward feeds, as indices into its flat ``input_ids`` (batch order)."""
    flat: List[int] = []
    start = 0
    for req, prefix, new in zip(reqs, prefix_lens, new_lens):
        flat += [start + p - int(prefix) for p in override_positions(req) if 0 <= p - int(prefix) < int(new)]
        start += int(new)
    return flat


def marked_ids(input_ids: torch.Tensor, flat: Sequence[int]) -> torch.Tensor:
    """A copy of ``input_ids`` (int, [tokens]) with the marker at ``flat``: the ids the canary checks the forward's
    fed tokens against; ``input_ids`` itself when ``flat`` is empty (no copy)."""
    if not flat:
        return input_ids
    marked = input_ids.clone()
    marked[torch.tensor(list(flat), dtype=torch.int64, device=input_ids.device)] = EMBED_OVERRIDE_TOKEN
    return marked
