"""EAGLE3 runs through EAGLE's worker and batches in sglang 0.5.12 (what lets the canary verify it unchanged),
and the tiny target captures the hidden states sglang's ``ModelRunner`` asks for, as sglang's Llama does.

The e2e (``test_e2e_speculative_eagle3``) serves EAGLE3; these pin the reading of sglang's code it rests on,
so that a sglang whose EAGLE3 path departs from EAGLE's fails here, by name, rather than in a server.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module", autouse=True)
def _sgl_kernel_importable():
    """sglang's EAGLE worker modules import sgl_kernel, which needs a ``libcuda.so.1``: without the NVIDIA driver,
    the stand-in the CPU e2e servers use is loaded first (by soname), as in test_speculative_draft."""
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
