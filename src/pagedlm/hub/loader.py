"""Model weights, in Hugging Face naming and layout, from a GGUF file or an HF safetensors dir (their config:
hf_config.py).

A path is an HF model directory if it is a directory, else a GGUF file (see `registry.resolve_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from pagedlm.hub.blocks import Int4Blocks, LazyRows, RawBlocks
from pagedlm.hub.gguf_names import hf_name
from pagedlm.hub.hf_config import gguf_config, load_hf_config, meta
from pagedlm.hub.registry import ModelLoadError, open_gguf

__all__ = ["iter_weights", "load_hf_config", "open_gguf"]


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


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)` on Q/K rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _iter_gguf(path: Path, dtype: torch.dtype, native: Collection[str] = (),
               lazy: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | Int4Blocks | LazyRows]]:
    reader = open_gguf(path)
    cfg = gguf_config(path, reader)
    arch = meta(reader, "general.architecture")
    # llama.cpp permutes the Q/K rows of its llama architecture (LLaMA, Mistral, Mixtral) and of smollm3, and stores
    # Gemma's (1 + w) norm weights as 1 + w.
    heads = ({"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
             if arch in ("llama", "smollm3") else {})
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        if t.tensor_type.name in native and name.endswith("proj.weight") and "{}" in name:
            # a stack of experts, each expert's rows as stored; the stack's pages are released after the last
            release = _after(t.data.shape[0], lambda t=t: reader.release(t))
            for e in range(t.data.shape[0]):
                yield name.format(e), RawBlocks.from_gguf(t.data[e], t.tensor_type.name, t.shape[0], release,
                                                          f"{t.name}#{e}")
            continue
        if t.tensor_type.name in native and name.endswith("proj.weight"):
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


def _after(n: int, release: Callable[[], None]) -> Callable[[], None]:
    """`release`, run on the n-th call."""
    left = [n]

    def one() -> None:
        left[0] -= 1
        if left[0] == 0:
            release()
    return one


def _owned(w: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`w` as a tensor in `dtype` that does not hold on to the file's pages (read-only views of the mapping are
    copied; arrays dequantization made are taken as they are)."""
    if not w.flags.writeable or not w.flags.c_contiguous:
        w = np.copy(w)
    return torch.from_numpy(w).to(dtype)
