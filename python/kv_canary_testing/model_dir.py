"""Write a model folder for the tiny external model: config.json plus a local tokenizer.

Nothing is downloaded: the tokenizer is a ``tokenizers`` WordLevel model over a
fixed vocabulary of words ``w0`` .. ``w{N-1}`` plus four special tokens, split on
whitespace. Weights are not written; the server runs with ``--load-format dummy``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from kv_canary_testing import default_cache_dir

ARCHITECTURE = "KvcTinyForCausalLM"

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
NUM_WORDS = 508  # 4 specials + 508 words = vocab_size 512: every id decodes
FIRST_WORD_ID = len(SPECIAL_TOKENS)

DEFAULT_CONFIG = {
    "architectures": [ARCHITECTURE],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    # Seed for the deterministic re-initialisation done after a dummy load.
    "kvc_init_seed": 20240501,
}


def word(i: int) -> str:
    """Return the i-th vocabulary word (``w{i}``)."""
    return f"w{i}"


def word_token_id(i: int) -> int:
    """Return the token id of the i-th vocabulary word."""
    return FIRST_WORD_ID + i


def vocabulary(num_words: int = NUM_WORDS) -> dict[str, int]:
    """Return the token -> id map of the tokenizer."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(num_words):
        vocab[word(i)] = word_token_id(i)
    return vocab


def _build_tokenizer_json(num_words: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(num_words), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str(pretty=True)


def _tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": max_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text() == text:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_model_dir(
    path: str | os.PathLike | None = None,
    config_overrides: dict | None = None,
    num_words: int = NUM_WORDS,
) -> Path:
    """Write (idempotently) a model folder for ``KvcTinyForCausalLM`` and return its path.

    ``path`` defaults to ``<cache>/tiny-model``; ``config_overrides`` updates the
    config (e.g. ``{"num_hidden_layers": 4}``).
    """
    config = dict(DEFAULT_CONFIG)
    config.update(config_overrides or {})
    if num_words + FIRST_WORD_ID > config["vocab_size"]:
        raise ValueError(
            f"vocab_size {config['vocab_size']} is smaller than the tokenizer "
            f"({num_words + FIRST_WORD_ID} tokens)"
        )
    out = Path(path) if path is not None else default_cache_dir() / "tiny-model"
    out.mkdir(parents=True, exist_ok=True)
    _write_if_changed(out / "config.json", json.dumps(config, indent=2) + "\n")
    _write_if_changed(
        out / "generation_config.json",
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                    "pad_token_id": PAD_ID}, indent=2) + "\n",
    )
    _write_if_changed(out / "tokenizer.json", _build_tokenizer_json(num_words) + "\n")
    _write_if_changed(
        out / "tokenizer_config.json",
        json.dumps(_tokenizer_config(config["max_position_embeddings"]), indent=2) + "\n",
    )
    _write_if_changed(
        out / "special_tokens_map.json",
        json.dumps({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
                    "pad_token": "<pad>"}, indent=2) + "\n",
    )
    return out


def write_eagle_model_dirs(root: str | os.PathLike | None = None, branch_scale: float = 0.3,
                           overrides: dict | None = None) -> tuple[Path, Path]:
    """(target, draft) folders for EAGLE on the tiny models (``kv_canary_testing.spec_cpu``).

    ``overrides`` update both configs (e.g. ``{"head_dim": 64}`` for attention backends without head_dim 16).

    The target's attention/MLP add ``branch_scale`` of their usual weight to the residual
    stream and the draft (``KvcTinyForCausalLMEagle``, one layer) passes the token's embedding
    through: the draft predicts what the target would without its branches, so drafts are
    accepted often but not always -- every verify outcome occurs (all, some, none accepted).
    """
    base = Path(root) if root is not None else default_cache_dir()
    target = write_model_dir(base / "tiny-eagle-target", {"kvc_branch_scale": branch_scale, **(overrides or {})})
    draft = write_model_dir(base / "tiny-eagle-draft", {
        "architectures": ["KvcTinyForCausalLMEagle"], "num_hidden_layers": 1,
        "kvc_branch_scale": 0.0, "kvc_eagle_identity_fc": True, **(overrides or {}),
    })
    return target, draft


EAGLE3_AUX_LAYER_IDS = (0, 1)  # the target's hidden states entering layers 1 and 2 go to the draft


def write_eagle3_model_dirs(root: str | os.PathLike | None = None, branch_scale: float = 0.3) -> tuple[Path, Path]:
    """(target, draft) folders for EAGLE3 on the tiny models (``kv_canary_testing.spec_cpu``).

    The target (3 layers, branches scaled as for EAGLE) captures its hidden states entering layers
    1 and 2 (the draft's ``eagle_config.eagle_aux_hidden_state_layer_ids`` [0, 1], read by sglang's
    ``ModelRunner``); the draft (``KvcTinyForCausalLMEagle3``) maps their concatenation through its
    ``fc`` and, with ``kvc_eagle3_embed_residual``, predicts what the target would without its
    branches: drafts are accepted often but not always.
    """
    base = Path(root) if root is not None else default_cache_dir()
    ids = list(EAGLE3_AUX_LAYER_IDS)
    target = write_model_dir(base / "tiny-eagle3-target", {
        "kvc_branch_scale": branch_scale, "num_hidden_layers": 3, "num_aux_hidden_states": len(ids)})
    draft = write_model_dir(base / "tiny-eagle3-draft", {
        "architectures": ["KvcTinyForCausalLMEagle3"], "num_hidden_layers": 1, "kvc_branch_scale": 0.0,
        "kvc_eagle3_embed_residual": True, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
    })
    return target, draft


SWA_ARCHITECTURE = "LagunaForCausalLM"  # kvc_tiny_swa: the tiny model under a hybrid-SWA name
SWA_WINDOW = 24  # config.sliding_window: sglang's sliding_window_size for the SWA layers


def swa_config_overrides(window: int = SWA_WINDOW) -> dict:
    """Config of the hybrid sliding-window tiny model: layer 0 sliding, layer 1 full, 4 layers in all."""
    return {
        "architectures": [SWA_ARCHITECTURE],
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": window,
    }


def write_swa_model_dir(path: str | os.PathLike | None = None, window: int = SWA_WINDOW) -> Path:
    """``write_model_dir`` for the hybrid-SWA tiny model (default folder ``<cache>/tiny-model-swa``)."""
    out = Path(path) if path is not None else default_cache_dir() / "tiny-model-swa"
    return write_model_dir(out, config_overrides=swa_config_overrides(window))


MLA_ARCHITECTURE = "MiniCPM3ForCausalLM"  # kvc_tiny_mla: the tiny model with MLA attention under an MLA name


def mla_config_overrides(wide: bool = False, rope_apart: bool = False) -> dict:
    """Config of the MLA tiny model: latent 32 + rotary 16 values per slot and layer (192 bytes in float32).

    ``wide``: DeepSeek-V2/V3's widths, latent 512 + rotary 64 (576 values per row), the only MLA head sizes
    sglang 0.5.12's Triton MLA kernels are built for (``decode_attention``/``extend_attention``: Lk 576 or
    288 take the split latent/rotary path; the narrow row does not compile there). For the GPU host.
    ``rope_apart``: the model stores its row through ``set_mla_kv_buffer`` (latent and rotary part apart), as the
    backends of DeepSeek's absorbed path need (fa3: ``kvc_tiny_mla``'s ``kvc_mla_rope_apart``).
    """
    lora, rope = (512, 64) if wide else (32, 16)
    # wide: bf16 as DeepSeek serves (the Triton MLA kernels' tiles are sized for 16-bit queries; CPU passes
    # --dtype float32 whatever the config says)
    return {"architectures": [MLA_ARCHITECTURE], "kv_lora_rank": lora, "qk_rope_head_dim": rope,
            "qk_nope_head_dim": 128 if wide else 16, "v_head_dim": lora,
            **({"torch_dtype": "bfloat16"} if wide else {}), **({"kvc_mla_rope_apart": True} if rope_apart else {})}


def write_mla_model_dir(path: str | os.PathLike | None = None, wide: bool = False, rope_apart: bool = False) -> Path:
    """``write_model_dir`` for the MLA tiny model (default folder ``<cache>/tiny-model-mla[-wide][-rope-apart]``)."""
    name = "tiny-model-mla" + ("-wide" if wide else "") + ("-rope-apart" if rope_apart else "")
    out = Path(path) if path is not None else default_cache_dir() / name
    return write_model_dir(out, config_overrides=mla_config_overrides(wide, rope_apart))


QWEN3_NEXT_ARCHITECTURE = "Qwen3NextForCausalLM"  # sglang's own class (no external model: GPU host only)


def qwen3_next_config_overrides() -> dict:
    """A tiny Qwen3-Next (hybrid linear attention): 4 layers, layer 3 full attention (gated, partial rotary),
    layers 0-2 Gated DeltaNet, a 4-expert MoE MLP. sglang builds ``HybridLinearKVPool`` (the full layer's
    K/V in an inner ``MHATokenToKVPool``, the linear layers' conv/ssm state in a ``MambaPool``).
    head_dim 128: sglang's CUDA rotary kernel takes 64/128/256/512 (others JIT-compile a fallback)."""
    return {
        "architectures": [QWEN3_NEXT_ARCHITECTURE], "model_type": "qwen3_next", "torch_dtype": "bfloat16",
        "num_hidden_layers": 4, "full_attention_interval": 4, "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "decoder_sparse_step": 1,
        "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "num_experts_per_tok": 2,
        "num_experts": 4, "norm_topk_prob": True, "mlp_only_layers": [],
    }


def write_qwen3_next_model_dir(path: str | os.PathLike | None = None) -> Path:
    """``write_model_dir`` for the tiny Qwen3-Next (default folder ``<cache>/tiny-model-qwen3-next``)."""
    out = Path(path) if path is not None else default_cache_dir() / "tiny-model-qwen3-next"
    return write_model_dir(out, config_overrides=qwen3_next_config_overrides())


TINY_HYBRID_LINEAR_ARCHITECTURE = "KvcTinyHybridLinearForCausalLM"  # kv_canary_testing.tiny_model.kvc_tiny_hybrid_linear


def write_tiny_hybrid_linear_model_dir(path: str | os.PathLike | None = None) -> Path:
    """The tiny Qwen3-Next config (sglang's ``Qwen3NextConfig``: ``HybridLinearKVPool``, FULL + MAMBA radix
    cache) served by the tiny model's CPU stand-in (float32; default folder ``<cache>/tiny-model-hybrid-linear``)."""
    out = Path(path) if path is not None else default_cache_dir() / "tiny-model-hybrid-linear"
    return write_model_dir(out, config_overrides={**qwen3_next_config_overrides(), "torch_dtype": "float32",
                                                  "architectures": [TINY_HYBRID_LINEAR_ARCHITECTURE]})


MIMO_ARCHITECTURE = "MiMoForCausalLM"  # sglang's own; as a draft ModelConfig renames it to MiMoMTP


def mimo_config_overrides() -> dict:
    """A tiny MiMo (Qwen2 layers + one multi-token-prediction layer): sglang 0.5.12 serves it with
    ``--speculative-algorithm NEXTN``/``EAGLE`` and the target's own folder as the draft, which
    ``ModelConfig._config_draft_model`` turns into ``MiMoMTP`` (its own one-layer ``MHATokenToKVPool``).
    head_dim 64: sglang's CUDA rotary kernel takes 64/128/256/512."""
    return {
        "architectures": [MIMO_ARCHITECTURE], "model_type": "qwen2", "torch_dtype": "bfloat16",
        "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_nextn_predict_layers": 1, "use_sliding_window": False,
        "max_window_layers": 2,
    }


def write_mimo_model_dir(path: str | os.PathLike | None = None) -> Path:
    """``write_model_dir`` for the tiny MiMo (default folder ``<cache>/tiny-model-mimo``)."""
    out = Path(path) if path is not None else default_cache_dir() / "tiny-model-mimo"
    return write_model_dir(out, config_overrides=mimo_config_overrides())
