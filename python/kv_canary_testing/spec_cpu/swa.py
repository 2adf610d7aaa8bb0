"""EAGLE (spec v2, topk 1) over the hybrid sliding-window tiny target on CPU (sglang 0.5.23's ``SWAKVPool``): the
model folders, server arguments and the workload shared by test_e2e_speculative_swa and #34870's three runs
(test_e2e_real_bugs_spec_0523).

The target is ``kvc_tiny_swa``'s ``LagunaForCausalLM`` (layers 0 and 2 sliding, window 24; one of this package's
entry classes) with EAGLE's branch scale, the draft the plain tiny EAGLE draft (its own ``MHATokenToKVPool``). sglang
serves it with ``UnifiedRadixCache`` (EAGLE's bigram keys), page size 16, chunked prefill at 128 and Triton attention
under the interpreter (the window applied by attention).
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Dict, List

from kv_canary_testing import default_cache_dir
from kv_canary_testing.spec_cpu.client import Out, generate
from kv_canary_testing.model_dir import NUM_WORDS, swa_config_overrides, word_token_id, write_eagle_model_dirs, \
    write_model_dir

PAGE = 16
POOL_TOKENS = 1024


def write_swa_eagle_model_dirs(root=None) -> tuple[Path, Path]:
    """(target, draft): the hybrid-SWA tiny target with EAGLE's branch scale, and the tiny EAGLE draft."""
    base = Path(root) if root is not None else default_cache_dir()
    _, draft = write_eagle_model_dirs(base)
    target = write_model_dir(base / "tiny-eagle-swa-target", {"kvc_branch_scale": 0.3, **swa_config_overrides()})
    return target, draft


def spec_swa_args(draft) -> List[str]:
    """EAGLE, 3 steps, topk 1, 4 draft tokens, page 16; ``--swa-full-tokens-ratio 1.0`` as test_e2e_swa."""
    return ["--attention-backend", "triton", "--speculative-algorithm", "EAGLE",
            "--speculative-draft-model-path", str(draft), "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
            "--speculative-draft-load-format", "dummy", "--max-running-requests", "8", "--page-size", str(PAGE),
            "--swa-full-tokens-ratio", "1.0"]


def words(rng: random.Random, n: int) -> List[int]:
    return [word_token_id(rng.randrange(NUM_WORDS)) for _ in range(n)]


# prompt lengths 16k + 1 (EAGLE's bigram key a whole number of pages: #34870's frontier), one past the chunk size
PROMPT_LENS = (49, 97, 161)
NEW_TOKENS = 40  # past the window of 24


def greedy_workload(srv, seed: int = 34870) -> Dict[int, Out]:
    """One request at a time, temperature 0 (each output comparable across servers): three prompts longer than the
    window, 40 decoded each (past the window: sglang frees their out-of-window SWA slots); then each prompt again
    with 16 new words (a radix hit on the first run's pages, then a window's worth of SWA read from the tree)."""
    rng = random.Random(seed)
    prompts = [words(rng, n) for n in PROMPT_LENS]
    out = {i: generate(srv, p, NEW_TOKENS) for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        out[10 + i] = generate(srv, p + words(rng, 16), NEW_TOKENS)
    return out


def sampled_workload(srv, seed: int = 7) -> Dict[int, Out]:
    """Two requests at once at temperature 0.8 (sglang's sampling verify; batch of two), over new prompts."""
    rng = random.Random(seed)
    prompts = [words(rng, 81), words(rng, 113)]
    out: Dict[int, Out] = {}

    def one(i):
        out[20 + i] = generate(srv, prompts[i], NEW_TOKENS, temperature=0.8)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
