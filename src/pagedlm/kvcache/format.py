"""The layout of one KV cache entry (a token's K or V for one kv head), shared by the torch backends and the C++
kernels: `head_dim` elements of the cache dtype, or, for a quantized cache, `head_dim` 1-byte values (int8 or fp8
e4m3) followed by their fp32 scale (SCALE_BYTES). The kernels name the cache dtypes by the KVKind codes below
(attention/csrc/paged_attention.cpp keeps the same numbers; tests/test_cbuild.py checks that they agree)."""
from __future__ import annotations

import torch

SCALE_BYTES = 4
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)

KV_F32, KV_BF16, KV_INT8, KV_FP8, KV_F16 = 0, 1, 2, 3, 4  # the kernels' KVKind
KV_KINDS = {torch.float32: KV_F32, torch.bfloat16: KV_BF16, torch.int8: KV_INT8, torch.float8_e4m3fn: KV_FP8,
            torch.float16: KV_F16}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def entry_dim(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, kv head) in the cache: head_dim, plus the SCALE_BYTES of scale when quantized."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def kv_kind(cache: torch.Tensor, head_dim: int) -> int | None:
    """The KVKind of a cache tensor [..., entry_dim], or None for a dtype or entry size the kernels do not read."""
    kind = KV_KINDS.get(cache.dtype)
    return kind if kind is not None and cache.shape[-1] == entry_dim(head_dim, cache.dtype) else None
