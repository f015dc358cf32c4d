"""Model config and weights, in Hugging Face naming and layout, from a GGUF file or an HF safetensors dir.

A path is an HF model directory if it is a directory, else a GGUF file (see `registry.resolve_model`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from pagedlm.model.quant import Int4Blocks
from pagedlm.model.registry import ModelLoadError

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
_ARCH_BLOCK_NAMES = {"llama": _BLOCK_NAMES, "gemma3": _GEMMA3_BLOCK_NAMES}
_IGNORED = {"rope_freqs"}


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, stamp: tuple[int, int]) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A `gguf.GGUFReader` for `path` (memoized per file version: parsing takes seconds)."""
    path = Path(path).resolve()
    try:
        st = path.stat()
        return _cached_reader(str(path), (st.st_size, st.st_mtime_ns))
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ModelLoadError(f"{path}: cannot read GGUF ({type(e).__name__}: {e})") from e


def _meta(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def load_hf_config(path: Path) -> dict[str, Any]:
    """HF-style config dict; always has the keys the model code relies on (see `_normalize`)."""
    path = Path(path)
    if path.is_dir():
        return _normalize(json.loads((path / "config.json").read_text()))
    return _normalize(_gguf_config(path, open_gguf(path)))


def _gguf_config(path: Path, reader: gguf.GGUFReader) -> dict[str, Any]:
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCH_BLOCK_NAMES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (supported: llama, gemma3)")

    def a(key: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    hidden, n_heads = a("embedding_length"), a("attention.head_count")
    emb = tensors.get("token_embd.weight")
    vocab = int(emb.shape[-1]) if emb is not None else len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling_type = a("rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": a("rope.scaling.factor")}
        if (orig := a("rope.scaling.original_context_length")) is not None:
            rope_scaling["original_max_position_embeddings"] = orig
    elif a("rope.scale_linear") is not None:
        rope_scaling = {"rope_type": "linear", "factor": a("rope.scale_linear")}
    types = {t.tensor_type for t in reader.tensors}
    q = gguf.GGMLQuantizationType
    torch_dtype = "bfloat16" if q.BF16 in types else "float16" if q.F16 in types else "float32"
    if arch == "gemma3":
        return {**_gemma3_config(a, hidden, n_heads, vocab, reader, tensors), "torch_dtype": torch_dtype}
    return {
        "model_type": "llama",
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


def _gemma3_config(a, hidden: int, n_heads: int, vocab: int, reader: gguf.GGUFReader,
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


def iter_weights(path: Path, dtype: torch.dtype = torch.float32,
                 native: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | Int4Blocks]]:
    """Yield (HF parameter name, tensor in `dtype` with HF shape) for every weight in the model.

    `lm_head.weight` is absent when embeddings are tied. GGUF tensors are dequantized and
    Q/K rows are un-permuted exactly as transformers does it, so results are bit-identical; linear weights
    whose GGUF type is in `native` (Q4_0, Q4_1) come as `Int4Blocks`, as stored.
    """
    path = Path(path)
    if path.is_dir():
        yield from _iter_safetensors(path, dtype)
    else:
        yield from _iter_gguf(path, dtype, native)


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


def _iter_gguf(path: Path, dtype: torch.dtype, native: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    reader = open_gguf(path)
    cfg = _gguf_config(path, reader)
    arch = "gemma3" if cfg["model_type"] == "gemma3_text" else "llama"
    # llama.cpp permutes LLaMA's Q/K rows and stores Gemma's (1 + w) norm weights as 1 + w.
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]} if arch == "llama" else {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        if t.tensor_type.name in native and name.endswith("proj.weight"):
            blocks = Int4Blocks.from_gguf(t.data, t.tensor_type.name)
            if (kind := t.name.split(".")[-2]) in heads:
                blocks = blocks.rows(_unpermute(np.arange(blocks.shape[0]), heads[kind]))
            yield name, blocks
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if (kind := t.name.split(".")[-2]) in heads:
            w = _unpermute(w, heads[kind])
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1
        yield name, torch.from_numpy(np.copy(w)).to(dtype)
