"""A tiny KV pool driven like sglang drives it, for the kernel tests: both backends (Triton, torch reference) on
identical pools (``Sim``), and the scenario the tests share (``scenario``: chunked prefill, a radix-shared prefix,
decode steps).

Importing this module sets ``TRITON_INTERPRET=1`` when no GPU is present (before Triton is imported), so on CPU the
Triton kernels run under the interpreter; on a GPU host they compile, on CUDA tensors (``DEVICE``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")

from kv_canary import fingerprint as fp  # noqa: E402
from kv_canary.buffer_groups import PoolLayout, build_group  # noqa: E402
from kv_canary.config import CanaryConfig, RealData  # noqa: E402
from kv_canary.token_oracle import TokenOracle  # noqa: E402
from kv_canary.views import ForwardView  # noqa: E402

NUM_SLOTS = 600
CTX = 160
LAYERS = 3


def extend_view(r2t: torch.Tensor, entries, *, fed=None, position_shift: int = 0, staged: bool = False) -> ForwardView:
    """An extend forward over ``entries`` ((row, prefix_len, new_token_ids, slots int64 [n])): the slots go into
    ``r2t`` ([rows, ctx] int32) at [prefix, prefix + n), the view feeds ``fed`` (else the new tokens) at positions
    + ``position_shift`` (int64 / int32 tensors on ``DEVICE``)."""
    ids, locs, rows, seqs, starts, lens, pos = [], [], [], [], [], [], []
    for row, prefix, toks, slots in entries:
        r2t[row, prefix : prefix + len(toks)] = slots.to(torch.int32).to(DEVICE)
        starts.append(len(ids))
        pos += [prefix + k + position_shift for k in range(len(toks))]
        ids += toks
        locs += slots.tolist()
        rows.append(row)
        seqs.append(prefix + len(toks))
        lens.append(len(toks))
    return ForwardView(
        input_ids=torch.tensor(fed if fed is not None else ids, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(pos, dtype=torch.int64, device=DEVICE),
        out_cache_loc=torch.tensor(locs, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor(seqs, dtype=torch.int64, device=DEVICE),
        new_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        new_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        batch_size=len(entries),
        max_new_len=max(lens),
        staged=staged,
    )


def decode_read_view(reqs) -> ForwardView:
    """HEAD's view of a decode forward reading positions [0, n) of each (row, n) in ``reqs`` (one new token a
    request at position n; int64 tensors on ``DEVICE``)."""
    return ForwardView(
        input_ids=torch.zeros(len(reqs), dtype=torch.int64, device=DEVICE),
        positions=torch.tensor([n for _, n in reqs], dtype=torch.int64, device=DEVICE),
        out_cache_loc=torch.zeros(len(reqs), dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor([r for r, _ in reqs], dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor([n + 1 for _, n in reqs], dtype=torch.int64, device=DEVICE),
        new_starts=torch.arange(len(reqs), dtype=torch.int64, device=DEVICE),
        new_lens=torch.ones(len(reqs), dtype=torch.int64, device=DEVICE),
        batch_size=len(reqs),
        max_new_len=1,
    )


def violations_since(counters: torch.Tensor, ring: torch.Tensor, before: int) -> list:
    """The violation rows reported since the counter read ``before`` (ring [capacity, RING_WIDTH] int64), as
    sorted tuples."""
    n = int(counters[fp.C_VIOLATIONS]) - before
    return sorted(tuple(ring[(before + i) % ring.shape[0]].tolist()) for i in range(n))


class Sim:
    """A tiny KV pool + req_to_token + a slot allocator, driven like sglang does."""

    def __init__(self, backend, seed=0, hash_layers=(0,), hash_bytes=16, with_v=True, real_data=RealData.PARTIAL,
                 full_hash=False, check_fed=True):
        self.check_fed = check_fed
        g = torch.Generator().manual_seed(seed)
        self.backend = backend
        self.k = [torch.randn(NUM_SLOTS, 2, 8, generator=g).to(DEVICE) for _ in range(LAYERS)]
        self.v = [torch.randn(NUM_SLOTS, 2, 8, generator=g).to(DEVICE) for _ in range(LAYERS)] if with_v else None
        config = CanaryConfig(kv_hash_layers=hash_layers, kv_hash_bytes=hash_bytes, real_data=real_data,
                              scrub_slots_per_forward=64 if full_hash else 0)  # full_hash: TAIL keeps FULL_HASH
        self.group = build_group(PoolLayout("full", self.k, self.v), config, DEVICE)
        self.r2t = torch.zeros(8, CTX, dtype=torch.int32, device=DEVICE)
        self.oracle = TokenOracle(rows=8, max_batch_size=8, max_tokens_per_forward=2 * CTX, device=DEVICE,
                                  check_fed=check_fed)
        self.own = {}  # row -> the request's own tokens (the scheduler's record: prompt + sampled ids)
        self.keys = {}  # row -> admission key (a new one: a new request in the row)
        self.counters = torch.zeros(fp.NUM_COUNTERS, dtype=torch.int64, device=DEVICE)
        self.counters[fp.C_REPORT_ENABLED] = 1
        self.ring = torch.zeros(256, fp.RING_WIDTH, dtype=torch.int64, device=DEVICE)
        self.next_slot = 1
        self.rng = torch.Generator().manual_seed(seed + 1)

    def alloc(self, n):
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return slots

    def admit(self, row, tokens=()):
        """A new request in ``row`` whose own tokens start with ``tokens`` (its cached prefix, say)."""
        self.own[row] = list(tokens)
        self.keys[row] = (row, self.keys.get(row, (row, 0))[1] + 1)

    def sample(self, toks):
        """The engine sampled ``toks`` (batch order of the last forward): the sample hook's copy."""
        self.oracle.record_sampled(torch.tensor(toks, dtype=torch.int32, device=DEVICE))

    def forward(self, reqs, position_shift=0, fed=None, decode=False, unfinished=()):
        """reqs: list of (row, prefix_len, new_token_ids). Fills KV for new tokens, then TAIL-writes.

        The new tokens are the requests' own (the scheduler's record) unless ``fed`` gives other ids
        to feed; the model runs at positions + ``position_shift``. An extend forward (default) stages
        the record in the token oracle; a ``decode`` one expects each request's sampled token (``sample``
        after the previous forward). Rows in ``unfinished`` have more prompt after this chunk.
        """
        entries, fed_requests = [], []
        for row, prefix, toks in reqs:
            if row not in self.keys:
                self.admit(row)
            own = self.own[row]
            del own[prefix:]
            own += list(toks)
            if row in unfinished:
                own.append(1)  # the record already holds the next prompt token
            fed_requests.append((row, self.keys[row], prefix, len(toks),
                                 lambda o=list(own): (o, [])))
            entries.append((row, prefix, toks, self.alloc(len(toks))))
        view = extend_view(self.r2t, entries, fed=fed, position_shift=position_shift, staged=not decode)
        if not decode:
            self.oracle.stage(fed_requests)
        self.backend.launch_verify(self.group, view, self.r2t, self.counters, self.ring, 2, 16,
                                   token_oracle=self.oracle)
        # "attention" writes K/V of the new slots
        for layer in range(LAYERS):
            loc = view.out_cache_loc
            self.k[layer][loc] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
            if self.v is not None:
                self.v[layer][loc] = torch.randn(len(loc), 2, 8, generator=self.rng).to(DEVICE)
        self.backend.launch_write(self.group, view, self.r2t, self.counters, self.ring, True, block=16,
                                  check_fed=self.check_fed, token_oracle=self.oracle)
        for row in unfinished:
            self.own[row].pop()
        return view

    def new_violations(self, before):
        return violations_since(self.counters, self.ring, before)

    def verify_all(self, reqs):
        """reqs: list of (row, length): HEAD-verify positions [0, length) (as a decode forward would)."""
        view = decode_read_view(reqs)
        before = int(self.counters[fp.C_VIOLATIONS])
        self.backend.launch_verify(self.group, view, self.r2t, self.counters, self.ring, 3, 16,
                                   token_oracle=self.oracle)
        return self.new_violations(before)


def scenario(sim: Sim):
    """Chunked prefill of rows 1-3, row 4 sharing row 1's first 40 slots, three decode steps; each row's length."""
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(1, 500, (n,), generator=g).tolist()  # noqa: E731
    shared = tok(40)
    # chunked prefill: row 1 gets 40 + 50 tokens in two chunks, row 2 a 70-token prompt in one
    sim.forward([(1, 0, shared), (2, 0, tok(70))])
    sim.forward([(1, 40, tok(50)), (3, 0, tok(33))])
    # row 4 shares row 1's first 40 slots (a radix hit), then extends with its own tokens
    sim.r2t[4, :40] = sim.r2t[1, :40]
    sim.admit(4, sim.own[1][:40])  # the new request's own prompt starts like row 1's (admission: the chain)
    sim.forward([(4, 40, tok(37))])
    # decode steps for everybody: a mixed batch (staged), then decode forwards fed the sampled tokens
    toks = [tok(1) for _ in range(3)]
    sim.forward([(1, 90, toks[0]), (2, 70, toks[1]), (4, 77, toks[2])])
    for step in range(1, 3):
        toks = [tok(1) for _ in range(3)]
        sim.sample([t[0] for t in toks])
        sim.forward([(1, 90 + step, toks[0]), (2, 70 + step, toks[1]), (4, 77 + step, toks[2])], decode=True)
    return {1: 93, 2: 73, 3: 33, 4: 80}
