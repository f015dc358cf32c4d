"""Paged attention backends. All take q [tokens, heads, dim], the layer's paged K/V cache and the batch's
AttentionMetadata, and return [tokens, heads, dim].

"cpu": the compiled kernel (cpu_kernel.py), K/V read in place; "sdpa": torch SDPA per sequence over gathered
K/V; "reference": the oracle. "auto" picks "cpu" on CPU where the kernel builds, else "sdpa".
"""
from __future__ import annotations

import logging
from typing import Callable

from pagedlm.attention.cpu_kernel import load_kernel, paged_attention_cpu
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.attention.reference import paged_attention_reference, write_kv
from pagedlm.attention.torch_sdpa import paged_attention_sdpa

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., "torch.Tensor"]  # noqa: F821

BACKENDS: dict[str, AttentionFn] = {
    "reference": paged_attention_reference,
    "sdpa": paged_attention_sdpa,
    "cpu": paged_attention_cpu,
}


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionFn:
    if name == "auto":
        if str(device).startswith("cpu") and load_kernel() is not None:
            name = "cpu"
        else:
            name = "sdpa"
            if str(device).startswith("cpu"):
                logger.warning("Falling back to the 'sdpa' attention backend.")
        logger.info("Attention backend: %s", name)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)} or 'auto', got {name!r}.")
    return BACKENDS[name]


__all__ = ["AttentionMetadata", "get_attention_backend", "write_kv", "BACKENDS"]
