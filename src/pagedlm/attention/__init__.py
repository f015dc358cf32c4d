"""Paged attention backends. All take q [tokens, heads, dim], the layer's paged K/V cache and the batch's
AttentionMetadata, and return [tokens, heads, dim]."""
from __future__ import annotations

from typing import Callable

from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.attention.reference import paged_attention_reference, write_kv
from pagedlm.attention.torch_sdpa import paged_attention_sdpa

AttentionFn = Callable[..., "torch.Tensor"]  # noqa: F821

BACKENDS: dict[str, AttentionFn] = {
    "reference": paged_attention_reference,
    "sdpa": paged_attention_sdpa,
}


def get_attention_backend(name: str = "auto") -> AttentionFn:
    if name == "auto":
        name = "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)} or 'auto', got {name!r}.")
    return BACKENDS[name]


__all__ = ["AttentionMetadata", "get_attention_backend", "write_kv", "BACKENDS"]
