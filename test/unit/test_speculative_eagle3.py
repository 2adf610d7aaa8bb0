"""EAGLE3 runs through EAGLE's worker and batches in sglang 0.5.12 (what lets the canary verify it unchanged),
and the tiny target captures the hidden states sglang's ``ModelRunner`` asks for, as sglang's Llama does.

The e2e (``test_e2e_speculative_eagle3``) serves EAGLE3; these pin the reading of sglang's code it rests on,
so that a sglang whose EAGLE3 path departs from EAGLE's fails here, by name, rather than in a server.
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module", autouse=True)
def _sgl_kernel_importable():
    """sglang's EAGLE worker modules import sgl_kernel, which needs a ``libcuda.so.1``: without the NVIDIA driver,
    the stand-in the CPU e2e servers use is loaded first (by soname), as in speculative_draft_harness."""
    try:
        import sglang.srt.speculative.eagle_worker_v2  # noqa: F401
    except ImportError:
        import ctypes

        from kv_canary_testing.libcuda_stub import ensure_libcuda_stub

        ctypes.CDLL(str(ensure_libcuda_stub() / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)


def _worker_class(algorithm: str):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = SimpleNamespace(disable_overlap_schedule=False, enable_multi_layer_eagle=False)
    return SpeculativeAlgorithm.from_string(algorithm).create_worker(args)


def test_eagle3_is_served_by_the_same_spec_v2_worker_as_eagle():
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    assert _worker_class("EAGLE") is EAGLEWorkerV2
    assert _worker_class("EAGLE3") is EAGLEWorkerV2


def test_eagle3_changes_only_model_setup_not_the_batches():
    """Every ``is_eagle3`` branch of the spec v2 worker is in its setup (draft TP context, aux hidden-state flag,
    token map, lm_head sharing); the forwards the canary views (draft, draft_forward, the two draft extends,
    verify, forward_batch_generation) and the batch builders do not branch on EAGLE3."""
    from sglang.srt.speculative import eagle_info_v2, eagle_utils, eagle_worker_v2
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2, EagleDraftWorker

    setup = {"__init__", "init_token_map", "init_lm_head"}
    branching = {name for cls in (EagleDraftWorker, EAGLEWorkerV2) for name, fn in vars(cls).items()
                 if inspect.isfunction(fn) and "is_eagle3" in inspect.getsource(fn)}
    assert branching == setup, branching
    for name in ("draft", "draft_forward", "_draft_extend_for_prefill", "_draft_extend_for_decode"):
        assert "eagle3" not in inspect.getsource(getattr(EagleDraftWorker, name)).lower(), name
    for name in ("verify", "forward_batch_generation"):
        assert "eagle3" not in inspect.getsource(getattr(EAGLEWorkerV2, name)).lower(), name
    for module in (eagle_info_v2, eagle_utils):
        assert "eagle3" not in inspect.getsource(module).lower(), module.__name__
    assert "is_eagle3" in inspect.getsource(eagle_worker_v2)


def test_the_tiny_target_captures_the_layers_sglang_asks_for():
    """``set_eagle3_layers_to_capture`` maps ids as sglang's ``LlamaForCausalLM`` does (the states entering layer
    id + 1); ids outside the target are a clear error, not a silently narrower draft input."""
    import torch

    from sglang.srt.models.llama import LlamaForCausalLM

    from kv_canary_testing.tiny_model.kvc_tiny import KvcTinyForCausalLM

    model = KvcTinyForCausalLM.__new__(KvcTinyForCausalLM)
    torch.nn.Module.__init__(model)
    model.config = SimpleNamespace(num_hidden_layers=3)
    model.model = SimpleNamespace(layers_to_capture=[])
    model.capture_aux_hidden_states = False
    model.set_eagle3_layers_to_capture([0, 1])
    assert model.model.layers_to_capture == [1, 2] and model.capture_aux_hidden_states
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        model.set_eagle3_layers_to_capture([0, 2])
    assert "[val + 1 for val in layer_ids]" in inspect.getsource(LlamaForCausalLM.set_eagle3_layers_to_capture)


def test_the_eagle3_model_dirs_agree_on_the_aux_layers():
    """The draft's eagle_config (read by sglang's target ModelRunner) and the target's num_aux_hidden_states
    (read by ``EagleDraftExtendInput.hidden_size_for``) name the same number of captured layers."""
    import json

    from kv_canary_testing.model_dir import EAGLE3_AUX_LAYER_IDS, write_eagle3_model_dirs
    from kv_canary_testing.tiny_model.kvc_tiny_eagle3 import num_aux_hidden_states

    def load(path):
        return json.loads((path / "config.json").read_text())

    target, draft = write_eagle3_model_dirs(None)
    t, d = load(target), load(draft)
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(EAGLE3_AUX_LAYER_IDS)
    assert t["num_aux_hidden_states"] == num_aux_hidden_states(SimpleNamespace(**d)) == len(EAGLE3_AUX_LAYER_IDS)
    assert all(0 <= i + 1 < t["num_hidden_layers"] for i in EAGLE3_AUX_LAYER_IDS)
    assert d["architectures"] == ["KvcTinyForCausalLMEagle3"]


def test_speculative_decoding_over_pools_it_was_not_run_with_is_refused():
    """MTP drafts (same worker, ``--speculative-algorithm EAGLE``/``NEXTN``) come with MLA, hybrid-SWA or hybrid
    linear-attention targets: refused on the target (naming the flag and value), skipped on the draft."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    from kv_canary.adapter.speculative import spec_pool_refusal

    def pool(cls):
        return cls.__new__(cls)

    for algo in ("EAGLE", "EAGLE3"):
        args = SimpleNamespace(speculative_algorithm=algo)
        assert spec_pool_refusal(args.speculative_algorithm, pool(MHATokenToKVPool), draft=False) == ""
        assert spec_pool_refusal(args.speculative_algorithm, pool(MHATokenToKVPool), draft=True) == ""
        for cls in (MLATokenToKVPool, SWAKVPool, HybridLinearKVPool):
            why = spec_pool_refusal(args.speculative_algorithm, pool(cls), draft=False)
            assert why.startswith(f"--speculative-algorithm {algo} with the target model's KV pool {cls.__name__}:")
            assert spec_pool_refusal(args.speculative_algorithm, pool(cls), draft=True).startswith(
                f"--speculative-algorithm {algo} with the draft model's KV pool {cls.__name__}:")
    assert spec_pool_refusal(None, pool(MLATokenToKVPool), draft=False) == ""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the draft harness (speculative_draft_harness) lays out CPU-tensor batches with sglang's "
                           "Triton helpers under the interpreter (CPU CI); on a GPU host "
                           "test_e2e_speculative_eagle3.py covers the EAGLE3 draft pool with real CUDA graphs")
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_radix_dedup_across_a_draft_chunk_boundary_is_not_reported(kernels):
    """Found by the EAGLE3 draft-pool perturbation probe (an unexplained ``kind=chain`` at a chunk boundary + 1;
    the draft pool no longer checks chain links, ``DraftCanaryManager``),
    reproduced here with the draft harness (speculative_draft_harness): row 1 prefilled positions [0, 20) in one
    chunk (its draft slot 15 holds token 16); row 2, the same tokens, in two chunks [0, 16) and [16, 20) (its own
    draft slot 15 holds the thrown-away sample, and position 16 chains from it); sglang's insert after row 2's
    second chunk (``RadixCache.cache_unfinished_req``: the EAGLE bigram key now covers position 15) finds
    [0, 16) in the tree (row 1's slots), frees row 2's duplicates and re-points ``req_to_token[row 2, :16]`` at
    row 1's slots. The next draft forward reads position 16 after row 1's slot 15, whose chain differs; a
    redirect to another position is still caught (test_speculative_draft_eager: ``kind=position``)."""
    from kv_canary import fingerprint as fp
    from speculative_draft_harness import DraftHarness, _rounds  # test/unit: on the path under pytest

    h = DraftHarness(steps=2, kernels=kernels)
    toks = list(range(3, 3 + 20))
    h.prefill({1: toks}, sampled={1: 50})
    h.prefill({2: toks[:16]}, sampled={2: 40}, chunk_end={2: True})
    h.prefill({2: toks[16:]}, sampled={2: 41})
    h.r2t[2, :16] = h.r2t[1, :16]
    _rounds(h, [2], [[2]])
    assert int(h.counters()[fp.C_VIOLATIONS]) == 0
