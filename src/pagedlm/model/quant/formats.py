"""Weight formats as tensors: int8 per channel (plain, packed in tiles of 4 rows, x16), int4 per group (rows, x16),
bf16 (x16), their conversions, and the Q8 activations the integer kernels multiply."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.hub.blocks import LazyRows


def quantize_int8(w: torch.Tensor | LazyRows, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scale fp32 [N]), `chunk` rows at a time (the fp32 temporaries of a
    128k-row embedding table would be GBs; LazyRows are dequantized by those rows)."""
    n, k = w.shape
    device = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")  # LazyRows: read on the host
    q = torch.empty(n, k, dtype=torch.int8, device=device)
    scale = torch.empty(n, dtype=torch.float32, device=device)
    for i in range(0, n, chunk):
        rows = w[i:i + chunk].float()
        s = (rows.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q[i:i + chunk] = torch.round(rows / s[:, None]).clamp_(-127, 127)
        scale[i:i + chunk] = s
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def can_pack_int8(n: int, k: int) -> bool:
    return n % 4 == 0 and k % 16 == 0


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/4, K/16, 4, 16]: tiles of 4 rows stored as 64-byte chunks of 16 inputs of each row (the
    kernel's packed layout, one sequential stream per tile)."""
    n, k = q.shape
    return q.view(n // 4, 4, k // 16, 16).permute(0, 2, 1, 3).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    t, c = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(t * 4, c * 16)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed uint8 [N, K/2], scale fp16 [N, K/G], min fp16 [N, K/G]); layout as in the kernel."""
    n, k = w.shape
    if group_size % 32 or k % group_size:
        raise ValueError(f"int4 needs a group size that is a multiple of 32 and divides {k}, got {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8).half()
    mins = lo.half()
    q = torch.round((g - mins.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(n, k // 32, 2, 16)  # chunks of 32: values 0..15 low nibbles, 16..31 high nibbles
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    return packed.contiguous(), scale.contiguous(), mins.contiguous()


X16 = 16  # output rows per tile of the int4 x16 layout (csrc/quant_linear.cpp)


def to_x16(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The int4 row layout ([N, K/2] codes, [N, K/G] scales and minimums) reordered into the kernel's x16 layout:
    per tile of 16 output rows and 32-value block, bytes 4c..4c+3 of each row side by side, chunk by chunk."""
    n, half = packed.shape
    codes = packed.view(n // X16, X16, half // 16, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    return (codes.view(n, half), *(t.view(n // X16, X16, -1).transpose(1, 2).contiguous().view(n, -1)
                                   for t in (scale, mins)))


def from_x16(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inverse of `to_x16`."""
    n, half = packed.shape
    codes = packed.view(n // X16, half // 16, 4, X16, 4).permute(0, 3, 1, 2, 4).contiguous()
    return (codes.view(n, half), *(t.view(n // X16, -1, X16).transpose(1, 2).contiguous().view(n, -1)
                                   for t in (scale, mins)))


def int8_to_x16(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] by rows -> the kernel's x16 layout: per tile of 16 rows and 32-value block, bytes 4c..4c+3 of
    each row side by side, chunk by chunk (c = 0..7)."""
    n, k = q.shape
    return q.view(n // X16, X16, k // 32, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(n, k)


def int8_from_x16(q: torch.Tensor) -> torch.Tensor:
    """The inverse of `int8_to_x16`."""
    n, k = q.shape
    return q.view(n // X16, k // 32, 8, X16, 4).permute(0, 3, 1, 2, 4).contiguous().view(n, k)


def bf16_to_x16(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] by rows -> the kernel's bf16 x16 layout: per tile of 16 rows and pair of inputs (2p, 2p + 1), the
    16 rows' pairs side by side ([N/16, K/2, 16, 2], returned as [N, K])."""
    n, k = w.shape
    return w.view(n // X16, X16, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(n, k)


def bf16_from_x16(w: torch.Tensor) -> torch.Tensor:
    """The inverse of `bf16_to_x16`."""
    n, k = w.shape
    return w.view(n // X16, k // 2, X16, 2).permute(0, 2, 1, 3).contiguous().view(n, k)


def quantize_activations_q8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [.., K] (K a multiple of `block`) with each block of 32 values (256 for the K-quants, as llama.cpp's Q8_K)
    rounded to int8 steps of max|block| / 127: the values the int4 kernel multiplies (same rounding: half to even of
    x / d)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    d = torch.where(d > 0, d, torch.ones_like(d))
    return (torch.round(blocks / d) * d).reshape(x.shape)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = packed.shape[0], packed.shape[1] * 2
    chunks = packed.reshape(n, k // 32, 1, 16)
    q = torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(n, k // group_size, group_size).float()
    return (q * scale.float()[..., None] + mins.float()[..., None]).reshape(n, k)


def prepack_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """A bf16 weight [N, K] reordered once into oneDNN's blocked layout, or None where that is not available (not
    bf16, not CPU, no oneDNN). Products of 8-64 rows over it run 1.1-2x faster than `x @ W.t()` or F.linear over
    the plain tensor (measured on Zen 4: oneDNN reorders a plain weight on every call), with bit-identical results
    (checked here on a few rows)."""
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        same = torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, w))
    except (RuntimeError, AttributeError):
        return None
    return packed if same else None
