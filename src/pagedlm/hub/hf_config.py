"""A model's config as a Hugging Face config dict, from a GGUF file's metadata or an HF directory's config.json.

Torch-free: the tokenizer and the CLI read it without importing the model code.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from pagedlm.hub.gguf_file import GGUFFile
from pagedlm.hub.gguf_names import ARCH_BLOCK_NAMES
from pagedlm.hub.registry import ModelLoadError, open_gguf

__all__ = ["gguf_config", "load_hf_config", "meta"]

_GGUF_MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "qwen2moe": "qwen2_moe",
                     "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "smollm3": "smollm3"}  # (llama.cpp: NoPE every 4th)


def meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def load_hf_config(path: Path) -> dict[str, Any]:
    """HF-style config dict; always has the keys the model code relies on (see `_normalize`)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text()) if path.is_dir() else gguf_config(path, open_gguf(path))
    try:
        return _normalize(cfg)
    except KeyError as e:
        raise ModelLoadError(f"{path}: its config lacks {e.args[0]!r}") from None


def gguf_config(path: Path, reader: GGUFFile) -> dict[str, Any]:
    arch = meta(reader, "general.architecture")
    if arch not in ARCH_BLOCK_NAMES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(ARCH_BLOCK_NAMES)})")

    def a(key: str, default: Any = None) -> Any:
        return meta(reader, f"{arch}.{key}", default)

    if meta(reader, "general.type", "model") != "model":  # e.g. "adapter": a LoRA for some model
        raise ModelLoadError(f"{path}: a GGUF {meta(reader, 'general.type')}, not a model")
    tensors = {t.name: t for t in reader.tensors}
    hidden, n_heads = a("embedding_length"), a("attention.head_count")
    emb = tensors.get("token_embd.weight")
    if hidden is None or n_heads is None or (emb is None and "tokenizer.ggml.tokens" not in reader.fields):
        raise ModelLoadError(f"{path}: the GGUF lacks a model's {arch}.embedding_length, {arch}.attention.head_count "
                             "or its vocabulary (token_embd.weight, tokenizer.ggml.tokens)")
    vocab = int(emb.shape[-1]) if emb is not None else len(reader.fields["tokenizer.ggml.tokens"])
    scaling_type = a("rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": a("rope.scaling.factor")}
        if (orig := a("rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = orig
    elif a("rope.scale_linear") is not None:
        rope_scaling = {"rope_type": "linear", "factor": a("rope.scale_linear")}
    elif "rope_freqs.weight" in tensors:  # llama.cpp's form of Llama 3.1 scaling: a divisor per frequency
        rope_scaling = {"rope_type": "freq_factors", "factors": _vector(tensors["rope_freqs.weight"])}
    types = {t.tensor_type for t in reader.tensors}
    q = gguf.GGMLQuantizationType
    torch_dtype = "bfloat16" if q.BF16 in types else "float16" if q.F16 in types else "float32"
    if arch == "gemma3":
        return {**_gemma3_config(a, hidden, n_heads, vocab, reader, tensors), "torch_dtype": torch_dtype}
    if arch == "phi3" and "rope_factors_long.weight" in tensors:
        rope_scaling = {"rope_type": "longrope",
                        "original_max_position_embeddings": a("rope.scaling.original_context_length"),
                        "long_factor": _vector(tensors["rope_factors_long.weight"]),
                        "short_factor": _vector(tensors["rope_factors_short.weight"])}
        if (attn := a("rope.scaling.attn_factor")) is not None:
            rope_scaling["attention_factor"] = attn
    return {
        **_llama_style_gguf(arch, a, tensors),
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": a("attention.head_count_kv", n_heads),
        "intermediate_size": a("feed_forward_length"),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": a("rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": a("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "head_dim": a("attention.key_length") or a("rope.dimension_count") or hidden // n_heads,
        "bos_token_id": meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": torch_dtype,
    }


def _vector(t) -> list[float]:
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).tolist()


def _llama_style_gguf(arch: str, a, tensors: dict) -> dict[str, Any]:
    """The family-specific keys of the LLaMA-style architectures, as HF config keys."""
    experts = a("expert_count") or 0
    model_type = _GGUF_MODEL_TYPES.get(arch) or ("mixtral" if experts else "llama")
    window = a("attention.sliding_window")
    if model_type == "llama" and window:
        model_type = "mistral"
    out: dict[str, Any] = {"model_type": model_type, "sliding_window": window}
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and window:
        out["use_sliding_window"] = True
    if model_type in ("qwen2", "qwen2_moe"):
        out["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    else:
        out["attention_bias"] = "blk.0.attn_output.bias" in tensors or "blk.0.attn_q.bias" in tensors
    if model_type == "olmoe":
        out["clip_qkv"] = a("attention.clamp_kqv")
    if experts:
        # llama.cpp renormalizes the chosen weights for Mixtral and Qwen3-MoE unless the file says otherwise
        norm = a("expert_weights_norm", model_type in ("mixtral", "qwen3_moe"))
        out.update(num_experts=experts, num_experts_per_tok=a("expert_used_count"), norm_topk_prob=bool(norm),
                   moe_intermediate_size=a("expert_feed_forward_length") or a("feed_forward_length"),
                   shared_expert_intermediate_size=a("expert_shared_feed_forward_length") or 0,
                   mlp_only_layers=[i for i in range(a("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in
                                    tensors])  # layers without a router are dense
    return out


def _gemma3_config(a, hidden: int, n_heads: int, vocab: int, reader: GGUFFile,
                   tensors: dict) -> dict[str, Any]:
    """What transformers builds from a gemma3 GGUF: the GGUF keys over Gemma3TextConfig's defaults
    (the local RoPE base, the 5:1 layer pattern and query_pre_attn_scalar are not in the file)."""
    n_layers = a("block_count")
    theta = a("rope.freq_base", 1_000_000.0)
    factor = a("rope.scaling.factor")  # Gemma 3 4B-27B: their global layers' linear scaling
    scaled = {"rope_type": a("rope.scaling.type", "linear"), "factor": factor} if factor else {"rope_type": "default"}
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": a("attention.head_count_kv", n_heads),
        "head_dim": a("attention.key_length", 256),
        "intermediate_size": a("feed_forward_length"),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"full_attention": {**scaled, "rope_theta": theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "sliding_window": a("attention.sliding_window", 4096),
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)],
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": a("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta(reader, "tokenizer.ggml.padding_token_id"),
    }


def _normalize(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults (LlamaConfig's) and flatten transformers 5's `rope_parameters` into
    `rope_theta` + `rope_scaling` (None or a dict with a `rope_type` key)."""
    hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = {"rope_type": scaling.get("rope_type", scaling.get("type")), **scaling}
        scaling = None if scaling["rope_type"] == "default" else scaling
    return {
        **cfg,
        "model_type": cfg.get("model_type", "llama"),
        "architectures": cfg.get("architectures") or ["LlamaForCausalLM"],
        "num_key_value_heads": cfg.get("num_key_value_heads") or n_heads,
        "head_dim": cfg.get("head_dim") or hidden // n_heads,
        "rms_norm_eps": cfg.get("rms_norm_eps") or 1e-6,
        "rope_theta": cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        "rope_scaling": scaling,
        "max_position_embeddings": cfg.get("max_position_embeddings") or 2048,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "torch_dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch."),
    }
