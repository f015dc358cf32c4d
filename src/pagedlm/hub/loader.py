"""Model config and weights, in Hugging Face naming and layout, from a GGUF file or an HF safetensors dir.

A path is an HF model directory if it is a directory, else a GGUF file (see `registry.resolve_model`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from pagedlm.hub.blocks import Int4Blocks, LazyRows, RawBlocks
from pagedlm.hub.gguf_file import GGUFFile
from pagedlm.hub.registry import ModelLoadError, open_gguf

__all__ = ["iter_weights", "load_hf_config", "open_gguf"]

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Experts: llama.cpp stacks them into one [experts, out, in] tensor per projection ("{}": the expert index).
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_ARCH_BLOCK_NAMES = {
    "llama": {**_BLOCK_NAMES, **_MOE_NAMES},  # LLaMA, Mistral, Mixtral
    "gemma3": _GEMMA3_BLOCK_NAMES,
    "qwen2": _BLOCK_NAMES,
    "qwen3": {**_BLOCK_NAMES, **_QK_NORM_NAMES},
    "phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused as in HF
    "qwen2moe": {**_BLOCK_NAMES, **_MOE_NAMES, **_SHARED_EXPERT_NAMES},
    "qwen3moe": {**_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES},
    "olmoe": {**_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES},
}
_GGUF_MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "qwen2moe": "qwen2_moe",
                     "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
_IGNORED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}


def _meta(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def load_hf_config(path: Path) -> dict[str, Any]:
    """HF-style config dict; always has the keys the model code relies on (see `_normalize`)."""
    path = Path(path)
    if path.is_dir():
        return _normalize(json.loads((path / "config.json").read_text()))
    return _normalize(_gguf_config(path, open_gguf(path)))


def _gguf_config(path: Path, reader: GGUFFile) -> dict[str, Any]:
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCH_BLOCK_NAMES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(_ARCH_BLOCK_NAMES)})")

    def a(key: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden, n_heads = a("embedding_length"), a("attention.head_count")
    emb = tensors.get("token_embd.weight")
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
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
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
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": theta},
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
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
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


def iter_weights(path: Path, dtype: torch.dtype = torch.float32, native: Collection[str] = (),
                 lazy: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | Int4Blocks | LazyRows]]:
    """Yield (HF parameter name, tensor in `dtype` with HF shape) for every weight in the model.

    `lm_head.weight` is absent when embeddings are tied. GGUF tensors are dequantized and
    Q/K rows are un-permuted exactly as transformers does it, so results are bit-identical; linear weights
    whose GGUF type is in `native` come as stored (Q4_0, Q4_1, Q4_K: `RawBlocks`), and the GGUF matrices named in
    `lazy` (HF names) as `LazyRows`, to be dequantized by rows by their consumer.
    """
    path = Path(path)
    if path.is_dir():
        yield from _iter_safetensors(path, dtype)
    else:
        yield from _iter_gguf(path, dtype, native, lazy)


def _iter_safetensors(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as st:
            for name in st.keys():
                if not name.endswith("rotary_emb.inv_freq"):
                    yield name, st.get_tensor(name).to(dtype)


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor ("{}" in it for a stack of experts), None for a tensor not loaded as a weight."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = _ARCH_BLOCK_NAMES[arch]
    if m and m[2] in names:
        return f"model.layers.{m[1]}.{names[m[2]]}.{suffix}"
    if base in _IGNORED:
        return None
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)` on Q/K rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _iter_gguf(path: Path, dtype: torch.dtype, native: Collection[str] = (),
               lazy: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | Int4Blocks | LazyRows]]:
    reader = open_gguf(path)
    cfg = _gguf_config(path, reader)
    arch = _meta(reader, "general.architecture")
    # llama.cpp permutes the Q/K rows of its llama architecture (LLaMA, Mistral, Mixtral) and stores Gemma's
    # (1 + w) norm weights as 1 + w.
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]} if arch == "llama" else {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        if t.tensor_type.name in native and name.endswith("proj.weight") and "{}" not in name:
            blocks = RawBlocks.from_gguf(t.data, t.tensor_type.name, t.shape[0], lambda t=t: reader.release(t), t.name)
            if (kind := t.name.split(".")[-2]) in heads:
                blocks = blocks.rows(_unpermute(np.arange(blocks.shape[0]), heads[kind]))
            yield name, blocks  # its pages are released once converted (see quant.Int4Linear)
            continue
        if name in lazy and len(t.shape) == 2:  # never a permuted (Q/K) or shifted (Gemma norm) tensor
            yield name, LazyRows(reader, t)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
        if (kind := t.name.split(".")[-2]) in heads:  # weights and biases alike
            w = _unpermute(w, heads[kind])
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1
        if kind == "ffn_gate_inp_shexp":
            w = w.reshape(1, -1)
        reader.release(t)
        if "{}" in name:  # a stack of experts
            for e in range(w.shape[0]):
                yield name.format(e), torch.from_numpy(np.copy(w[e])).to(dtype)
        else:
            yield name, _owned(w, dtype)
            del w


def _owned(w: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`w` as a tensor in `dtype` that does not hold on to the file's pages (read-only views of the mapping are
    copied; arrays dequantization made are taken as they are)."""
    if not w.flags.writeable or not w.flags.c_contiguous:
        w = np.copy(w)
    return torch.from_numpy(w).to(dtype)
