"""The token oracle (``kv_canary.token_oracle``): admissions' prefix chains, staged fed tokens, the chain cache,
and the numpy chain twin against torch and the records the kernels write (``kv_canary_testing.kernel_sim``)."""

from __future__ import annotations

import pytest
import torch

from kv_canary_testing.kernel_sim import DEVICE, Sim, scenario as _scenario

from kv_canary import fingerprint as fp
from kv_canary.kernels import reference as ref
from kv_canary.kernels import triton_kernels as tk
from kv_canary.token_oracle import TokenOracle



def test_token_oracle_leaves_the_fed_tokens_for_the_tail_and_admits_now():
    """``stage(fed_later=True)``: the admissions' chains now (HEAD's verify reads them), the fed tokens at
    ``stage_fed`` (the TAIL's write reads them): the same device state and remembered chains as in one step."""
    prompt = list(range(100, 180))

    def run(fed_later):
        oracle = TokenOracle(rows=6, max_batch_size=4, max_tokens_per_forward=128, device=DEVICE)
        reqs = [(2, "a", 40, 40, lambda: (prompt, [])), (3, "b", 0, 33, lambda: (prompt[:33], [7]))]
        assert oracle.stage(reqs, fed_later=fed_later) == 1
        assert int(oracle.row_chain[2]) == fp.prefix_chains_np([prompt[:40]])[0]
        before = oracle.staged[:75].tolist()
        assert oracle.fed_unstaged == fed_later
        oracle.stage_fed()
        assert not oracle.fed_unstaged
        oracle.stage_fed()  # nothing left: nothing staged twice
        oracle.remember_fed()
        return before, oracle.staged[:75].tolist(), sorted(oracle._chain_cache)

    before, later, remembered = run(True)
    _, now, remembered_now = run(False)
    assert before == [-1] * 75  # nothing staged before the TAIL
    assert later == now == prompt[40:80] + [-1] + prompt[:33] + [7]
    assert remembered == remembered_now == [33, 80]  # both fed prompts, their chains from the right bases


def test_admissions_left_for_the_anchor_read_their_prefixes_there():
    """``stage(fed_later=True, admit_later=True)`` (an extend whose verify runs at the model's last stage) leaves
    slicing the admitted prefixes off its launch: nothing is read from the records' prefixes until
    ``stage_admissions``, and a record that grew meanwhile (outputs appended past the prefix) gives the same
    chain over positions [0, prefix) as one read at ``stage``."""
    slices = []

    class Tokens(list):  # the scheduler's list, counting the slices taken of it
        def __getitem__(self, i):
            if isinstance(i, slice):
                slices.append((i.start, i.stop))
            return super().__getitem__(i)

    prompt, outputs = Tokens(range(300, 340)), Tokens([1, 2])
    oracle = TokenOracle(rows=4, max_batch_size=4, max_tokens_per_forward=64, device=DEVICE)
    assert oracle.stage([(1, "a", 41, 1, lambda: (prompt, outputs))], fed_later=True, admit_later=True) == 1
    assert int(oracle.row_chain[1]) == 0 and slices == []  # admitted, no chain yet, no token copied
    outputs.append(3)  # the scheduler appends a sampled token before the anchor runs
    oracle.stage_fed()  # the anchor: the admissions first, then the fed tokens
    assert (0, None) in slices  # the prefix [0, 41) = the prompt and outputs[:1], sliced here
    assert int(oracle.row_chain[1]) == fp.prefix_chains_np([list(range(300, 340)) + [1]])[0]
    assert oracle.staged[:2].tolist() == [2, 3]


def test_token_oracle_stages_the_fed_tokens_and_admits_a_request_once():
    oracle = TokenOracle(rows=4, max_batch_size=4, max_tokens_per_forward=16, device=DEVICE)
    # request a in row 2: 3 prompt tokens cached, fed the 4th and its first output
    assert oracle.stage([(2, "a", 3, 2, lambda: ([5, 6, 7, 8], [9]))]) == 1
    assert oracle.staged[:3].tolist() == [8, 9, -1]  # fed tokens, then the record's next one (unknown)
    assert int(oracle.row_chain[2]) == fp.prefix_chains_np([[5, 6, 7]])[0]
    # a continuation of the same request keeps the device chain; a new owner of the row is admitted
    oracle.row_chain[2] = 1234
    assert oracle.stage([(2, "a", 5, 1, lambda: ([5, 6, 7, 8], [9]))]) == 0
    assert int(oracle.row_chain[2]) == 1234 and oracle.staged[:2].tolist() == [-1, -1]  # not in the record yet
    assert oracle.stage([(2, "b", 2, 2, lambda: ([1, 2, 3, 4, 5], [])), (1, "c", 0, 1, lambda: ([7], []))]) == 1
    assert oracle.staged[:5].tolist() == [3, 4, 5, 7, -1]  # b's chunk is unfinished: the record has token 4
    assert int(oracle.row_chain[2]) == fp.prefix_chains_np([[1, 2]])[0]
    from kv_canary.views import CanaryCapacityError

    with pytest.raises(CanaryCapacityError, match="token oracle holds 16 tokens"):
        oracle.stage([(3, "d", 0, 17, lambda: (list(range(17)), []))])
    # PD: a request that arrived with its KV: chain over what the row holds, its next fed token
    oracle.init_row(3, [4, 5, 6], [7, 8])
    oracle.stage([])
    assert int(oracle.row_chain[3]) == fp.prefix_chains_np([[4, 5, 6, 7]])[0] and int(oracle.next_token[3]) == 8


def test_admissions_sharing_a_prefix_get_exact_chains_from_the_cache(monkeypatch):
    from kv_canary import token_oracle

    monkeypatch.setattr(token_oracle, "CHAIN_CACHE_TOKENS", 8)
    oracle = TokenOracle(rows=6, max_batch_size=6, max_tokens_per_forward=16, device=DEVICE)
    shared, other = [3, 1, 4, 1, 5], [3, 1, 4, 1, 6]
    reqs = [(1, "a", 5, 1, lambda: (shared + [9], [])), (2, "b", 5, 1, lambda: (other + [9], [])),
            (3, "c", 5, 1, lambda: (shared + [8], [])), (4, "d", 4, 1, lambda: (shared, []))]
    for round_ in range(2):  # the second round hits (or, past the cache's bound, recomputes) every prefix
        assert oracle.stage([(r, (k, round_), p, n, rec) for r, k, p, n, rec in reqs]) == 4
        want = fp.prefix_chains_np([shared, other, shared, shared[:4]])
        assert [int(oracle.row_chain[r]) for r in (1, 2, 3, 4)] == want
        assert oracle._cached_tokens <= 8 or len(oracle._chain_order) == 1


def test_chain_cache_tells_prefixes_of_one_length_apart(monkeypatch):
    """Remembered prefixes are looked up by length: each prefix of one length must still get its own chain, within
    one admission batch and across batches, and the cache keeps its entry bound (oldest out)."""
    from kv_canary import token_oracle

    monkeypatch.setattr(token_oracle, "CHAIN_CACHE_ENTRIES", 2)
    oracle = TokenOracle(rows=6, max_batch_size=6, max_tokens_per_forward=16, device=DEVICE)
    a, b, c, d = [3, 1, 4, 1, 5], [2, 7, 1, 8, 2], [3, 1, 4, 1, 5], [3, 1, 4, 1, 6]
    for round_ in range(3):
        reqs = [(1, ("a", round_), 5, 1, lambda: (a + [9], [])), (2, ("b", round_), 5, 1, lambda: (b + [9], [])),
                (3, ("c", round_), 5, 1, lambda: (c + [9], [])), (4, ("d", round_), 5, 1, lambda: (d + [8], []))]
        if round_ == 2:
            reqs = reqs[::-1]
        assert oracle.stage(reqs) == 4
        want = dict(zip((1, 2, 3, 4), fp.prefix_chains_np([a, b, c, d])))
        assert {r: int(oracle.row_chain[r]) for r in (1, 2, 3, 4)} == want
        assert len(oracle._chain_order) == 2 and oracle._cached_tokens == 10
        assert sum(len(same) for by_last in oracle._chain_cache.values() for same in by_last.values()) == 2


def test_admission_chains_extend_the_longest_remembered_prefix():
    """A multi-turn request's prefix extends a remembered one (the last turn's, a shared system prompt): its chain is
    the remembered chain plus the tokens after it, exactly the chain over all of it; a prefix that only looks like a
    remembered one at the checked tokens (first, middle, last) gets its own; an extension starts from the longest
    remembered prefix, not a shorter one."""
    g = torch.Generator().manual_seed(11)
    system = torch.randint(1, 150000, (40,), generator=g).tolist()
    turn = lambda n: torch.randint(1, 150000, (n,), generator=g).tolist()  # noqa: E731
    oracle = TokenOracle(rows=8, max_batch_size=8, max_tokens_per_forward=64, device=DEVICE)
    conv = [system + turn(7) for _ in range(3)]
    fake = list(system)
    fake[7] += 1  # neither first, middle nor last token of the system prompt: only the compare tells it apart
    prefixes = [system, *conv, fake]
    for round_ in range(3):
        reqs = [(r + 1, ("k", round_, r), len(p), 1, lambda p=p: (p + [5], [])) for r, p in enumerate(prefixes)]
        assert oracle.stage(reqs) == len(prefixes)
        assert [int(oracle.row_chain[r + 1]) for r in range(len(prefixes))] == fp.prefix_chains_np(prefixes)
        prefixes = [p + turn(5) for p in prefixes]  # the next turn: each prefix extended
    # every conversation's entries: its turns' prefixes, each found as the longest remembered one of the next
    assert oracle._longest_remembered(prefixes[1], sorted(oracle._chain_cache, reverse=True))[0] == len(prefixes[1]) - 5
    assert fp.prefix_chains_np([prefixes[1][6:]], starts=[6], bases=fp.prefix_chains_np([prefixes[1][:6]])) \
        == fp.prefix_chains_np([prefixes[1]])


def test_fed_prompts_are_remembered_for_the_next_turns_admission(monkeypatch):
    """After an admitted request's extend, ``remember_fed`` keeps the chain over its cached prefix and fed tokens: the
    next turn, whose cached prefix is this turn's prompt, is admitted without hashing it (only what follows), with
    the exact chain; a short extend or one whose tokens the record lacks is not remembered."""
    from kv_canary import token_oracle

    hashed = []
    real = token_oracle.prefix_chains_np

    def counting(prefixes, starts=None, bases=None):
        hashed.append(sum(len(p) for p in prefixes))
        return real(prefixes, starts=starts, bases=bases)

    monkeypatch.setattr(token_oracle, "prefix_chains_np", counting)
    g = torch.Generator().manual_seed(3)
    draw = lambda n: torch.randint(1, 150000, (n,), generator=g).tolist()  # noqa: E731
    oracle = TokenOracle(rows=8, max_batch_size=4, max_tokens_per_forward=2048, device=DEVICE)
    turn0 = [draw(300), draw(400)]
    assert oracle.stage([(1, "a0", 0, 300, lambda: (turn0[0], [])), (2, "b0", 0, 400, lambda: (turn0[1], []))]) == 0
    oracle.remember_fed()
    assert hashed == [700]  # the two prompts, from the staged tokens, after the launch
    turn1 = [turn0[0] + draw(260), turn0[1] + draw(10)]
    hashed.clear()
    assert oracle.stage([(3, "a1", 300, 260, lambda: (turn1[0], [7])), (4, "b1", 400, 10, lambda: (turn1[1], []))]) == 2
    assert hashed == []  # both cached prefixes were remembered: nothing hashed before the forward
    assert [int(oracle.row_chain[r]) for r in (3, 4)] == real(turn0)
    oracle.remember_fed()  # a1 (260 fed after a remembered prefix) is remembered, b1 (10 fed) is not
    assert hashed == [260]
    turn2 = [turn1[0] + [7] + draw(5), turn1[1] + draw(3)]
    hashed.clear()
    assert oracle.stage([(5, "a2", 560, 6, lambda: (turn2[0], [])), (6, "b2", 410, 3, lambda: (turn2[1], []))]) == 2
    assert hashed == [10]  # b2's 10 tokens after its remembered 400; a2's 560 remembered whole
    assert [int(oracle.row_chain[r]) for r in (5, 6)] == real([turn1[0], turn1[1]])
    # a request whose record does not hold its fed tokens yet is not remembered
    oracle.stage([(7, "c0", 0, 300, lambda: (draw(299), []))])
    oracle.remember_fed()
    assert len(oracle._chain_order) == 4  # turn0's two prompts, a1's prompt, b2's admitted prefix
    # a pending remember whose post-ops never ran is done by the next stage
    hashed.clear()
    again = draw(256)
    oracle.stage([(1, "d0", 0, 256, lambda: (again, []))])
    oracle.stage([(2, "e0", 256, 1, lambda: (again + [1], []))])
    assert hashed == [256] and int(oracle.row_chain[2]) == real([again])[0]
    # a chunked prefill: each chunk extends the last one's remembered chain, the whole prompt is remembered
    long = draw(500)
    oracle.stage([(3, "f0", 0, 300, lambda: (long, []))])
    oracle.remember_fed()
    oracle.stage([(3, "f0", 300, 200, lambda: (long, []))])
    oracle.remember_fed()
    hashed.clear()
    assert oracle.stage([(4, "f1", 500, 4, lambda: (long + draw(4), []))]) == 1
    assert hashed == [] and int(oracle.row_chain[4]) == real([long])[0]
    # a continuation after an unremembered chunk (another request's chain in the row) is not remembered
    other = draw(310)
    oracle.stage([(3, "g0", 0, 10, lambda: (other, []))])
    oracle.stage([(3, "g0", 10, 300, lambda: (other, []))])
    assert oracle._fed_pending == []


def test_an_admitted_prefix_is_remembered_only_where_no_longer_fed_prompt_will_be():
    """A request admitted with a cached prefix and fed >= FED_REMEMBER_MIN_TOKENS has its fed prompt (which extends
    the prefix) remembered after its forward: its prefix is not remembered too (one entry a turn, not two); a prefix
    the batch admits twice (a shared system prompt) and one whose request feeds too few tokens are."""
    g = torch.Generator().manual_seed(5)
    draw = lambda n: torch.randint(1, 150000, (n,), generator=g).tolist()  # noqa: E731
    oracle = TokenOracle(rows=8, max_batch_size=8, max_tokens_per_forward=2048, device=DEVICE)
    own, shared, short = draw(100), draw(80), draw(60)
    a, b, c, d = own + draw(40), shared + draw(40), shared + draw(40), short + draw(3)
    reqs = [(1, "a", 100, 40, lambda: (a, [])), (2, "b", 80, 40, lambda: (b, [])),
            (3, "c", 80, 40, lambda: (c, [])), (4, "d", 60, 3, lambda: (d, []))]
    assert oracle.stage(reqs) == 4
    assert [int(oracle.row_chain[r]) for r in (1, 2, 3, 4)] == fp.prefix_chains_np([own, shared, shared, short])
    assert sorted(len(t) for t, _ in oracle._chain_order) == [60, 80]  # the shared and the short-fed prefixes
    oracle.remember_fed()
    assert sorted(len(t) for t, _ in oracle._chain_order) == [60, 80, 120, 120, 140]  # + the fed prompts
    assert oracle._longest_remembered(a + [9], sorted(oracle._chain_cache, reverse=True)) == \
        (140, fp.prefix_chains_np([a])[0])


def test_numpy_chain_twin_is_bit_equal_to_torch_and_to_the_records():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 2**31 - 1, (3000,), generator=g)
    tokens[:4] = torch.tensor([0, 1, 2**31 - 1, 151000])
    positions = torch.randint(0, 1 << 20, (3000,), generator=g)
    import numpy as np

    assert np.array_equal(fp.chain_terms_np(tokens.numpy(), positions.numpy()).view(np.int64),
                          fp.chain_term(tokens, positions).numpy())
    sims = [Sim(tk), Sim(ref)]
    for s in sims:
        lengths = _scenario(s)
        for row, n in lengths.items():
            want = fp.prefix_chains_np([s.own[row][:n]])[0]
            assert int(s.group.records[int(s.r2t[row, n - 1]), fp.F_CHAIN]) == want == int(s.oracle.row_chain[row])


def test_numpy_prefix_chains_extend_from_starts_and_bases_and_skip_empty_sequences():
    """prefix_chains_np's one vectorized pass: sequences of any length (empty ones too) at any start position, each
    extended from its base, equal the torch chain over the whole prefix."""
    g = torch.Generator().manual_seed(7)
    whole = [torch.randint(0, 2**31 - 1, (n,), generator=g) for n in (1, 0, 300, 65, 0, 1088)]

    def chain(tokens):  # CHAIN over positions [0, len): the anchor plus every term (int64, wrapping)
        if not tokens.numel():
            return fp.CHAIN_ANCHOR
        return int((torch.tensor(fp.CHAIN_ANCHOR) + fp.chain_term(tokens, torch.arange(tokens.numel())).sum()).item())

    want = [chain(t) for t in whole]
    assert fp.prefix_chains_np([t.tolist() for t in whole]) == want
    cuts = [0, 0, 123, 64, 0, 1000]
    bases = fp.prefix_chains_np([t[:c].tolist() for t, c in zip(whole, cuts)])
    rests = [t[c:].numpy() for t, c in zip(whole, cuts)]
    assert fp.prefix_chains_np(rests, starts=cuts, bases=bases) == want
    assert fp.prefix_chains_np([rests[3]], starts=[64], bases=[bases[3]]) == [want[3]]
    assert fp.prefix_chains_np([[], []]) == [fp.CHAIN_ANCHOR] * 2
