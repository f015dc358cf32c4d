"""Quantized KV cache entries: each (token, kv head) holds `head_dim` 1-byte values (int8 or fp8 e4m3) followed
by their fp32 scale (the layout of kvcache/format.py), so a cache block is `[block_size, kv_heads, head_dim +
SCALE_BYTES]` bytes and carries its own scales: sharing, copy-on-write, swapping and prefix caching move blocks
without knowing they are quantized.

Values are quantized when written (`quantize_kv`, symmetric, scale = max|x| / qmax per token and head) and
dequantized inside the attention backends (`dequantize_kv` in the torch ones, the same arithmetic in the C++
kernel)."""
from __future__ import annotations

import torch

from pagedlm.kvcache.format import SCALE_BYTES, entry_dim, is_quantized

# "float32" / "bfloat16" / "float16": plain entries of that dtype, whatever the activations' dtype (fp16 saturating
# at +-65504, its largest finite value, rather than overflowing to infinity: `to_cache`).
KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
FP16_MAX = 65504.0
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the cache tensors for an EngineConfig.kv_cache_dtype."""
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V values as entries of a plain (not quantized) cache of `dtype`; fp16 saturates at +-FP16_MAX."""
    if dtype == torch.float16 and x.dtype != torch.float16:
        x = x.clamp(-FP16_MAX, FP16_MAX)
    return x.to(dtype)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float -> [..., D + SCALE_BYTES] of `dtype` (values, then the fp32 scale's bytes)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _QMAX[dtype]).clamp_min(1e-12)
    q = xf / scale
    q = q.round_().clamp_(-127, 127).to(torch.int8) if dtype == torch.int8 else q.to(dtype)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    out[..., :-SCALE_BYTES] = q.view(torch.uint8)
    out[..., -SCALE_BYTES:] = scale.view(torch.uint8)
    return out.view(dtype)


def dequantize_kv(packed: torch.Tensor) -> torch.Tensor:
    """[..., D + SCALE_BYTES] quantized entries -> [..., D] float32."""
    raw = packed.view(torch.uint8)
    values = raw[..., :-SCALE_BYTES].view(packed.dtype).float()
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return values * scale


__all__ = ["FP16_MAX", "KV_CACHE_DTYPES", "SCALE_BYTES", "cache_dtype", "dequantize_kv", "entry_dim", "is_quantized",
           "quantize_kv", "to_cache"]  # entry_dim, is_quantized: kvcache/format.py's
