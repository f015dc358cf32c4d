"""Building blocks shared by the model families."""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


_DEFERRED = ContextVar("pagedlm_deferred_weights", default=False)


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Inside, `weight_placeholder` makes weights on the meta device: shapes without memory, which
    `CausalLM.load_weights` replaces by the checkpoint's tensors, so that no full-precision copy of a quantized
    checkpoint is ever built."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weight_placeholder(*shape: int) -> torch.Tensor:
    """An uninitialized weight in the default dtype: on the meta device inside `deferred_weights`."""
    return torch.empty(*shape, device="meta") if _DEFERRED.get() else torch.empty(*shape)


def embedding(num: int, dim: int) -> nn.Embedding:
    """A frozen embedding table whose weight is a `weight_placeholder` (the checkpoint fills it)."""
    return nn.Embedding(num, dim, _weight=weight_placeholder(num, dim), _freeze=True)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as HF does). For float32 inputs the fused
    `F.rms_norm` gives bit-identical results and is faster (57 -> 38 us for one decode row, 2 threads)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Module):
    """y = x @ W^T: the one place a matmul happens, so quantized variants can replace it.

    Contract for replacements: `weight` is [out, in] while `load_weights` copies into it; afterwards
    `process_weights_after_loading()` may repack it into whatever layout `forward` wants ([*, in] -> [*, out]).
    Here that is W stored transposed ([in, out], multiplied as `x @ W`) where measurement showed it faster:
    float32 (batch-1 decode streams the weights faster, e.g. the 49k-row LM head 1.5x) and bf16 on CPUs with
    native bf16; on AVX2-only CPUs `x @ W` in bf16 is several times slower than `F.linear`, so W stays [out, in].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight_placeholder(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.transposed = False
        self.packed = False  # weight is a oneDNN-blocked bf16 weight (pack_bf16)

    def pack_bf16(self) -> bool:
        """Reorder a bf16 weight once into oneDNN's blocked layout (`quant.prepack_bf16`: bit-identical to
        F.linear, and on a Zen 4 2x `x @ W` at 1-8 rows, 1.1-1.3x at 64). Called after any quantization (the
        quantizer reads `weight` as [out, in]); afterwards `weight` is opaque to everything but `forward`."""
        from pagedlm.model.quant import prepack_bf16

        if self.packed or self.weight.dtype != torch.bfloat16 or self.weight.device.type != "cpu":
            return self.packed
        packed = prepack_bf16(self.weight.data.t() if self.transposed else self.weight.data)
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.packed, self.transposed = True, False
        return self.packed

    def process_weights_after_loading(self) -> None:
        if not self.transposed and prefer_transposed(self.weight.dtype, self.weight.device):
            self.weight = nn.Parameter(self.weight.data.t().contiguous(), requires_grad=False)
            self.transposed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).contiguous(), self.weight,
                                                   self.bias, "none", [], "")
            return y.view(*x.shape[:-1], self.out_features)
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x.reshape(-1, self.in_features),
                                                                      self.weight).view(*x.shape[:-1], -1)


def prefer_transposed(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `x @ W` with W as [in, out] beats `F.linear` (see Linear); measured on CPUs only."""
    if device.type != "cpu":
        return False
    from pagedlm.cpu import cpu_features

    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features().native_bf16)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The inverse frequencies of the position-independent RoPE types (default, linear, llama3, yarn)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"Unsupported rope scaling type {kind!r}.")


def _yarn_inv_freq(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) below the low-frequency bound, extrapolated (kept) above the
    high one, a linear ramp between (bounds from beta_fast / beta_slow rotations over the original length)."""
    factor, orig = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1 for the other types)."""
    s = scaling or {}
    kind = s.get("rope_type")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s["factor"]
    if factor <= 1:
        return 1.0
    if kind == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(s["original_max_position_embeddings"]))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
    return mscale(factor)


def rope_tables(head_dim: int, max_positions: int, theta: float,
                scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim / 2] of every position. Dynamic NTK and LongRoPE pick their
    frequencies by sequence length; a position p gets those of length p + 1, i.e. the ones HF transformers uses
    for the token at p when it is decoded (so HF's token-by-token generation is matched exactly whenever the
    prompt fits in the original context; a longer prompt is rotated per position, as vLLM does, not all with
    the frequencies of its full length)."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    kind = (scaling or {}).get("rope_type", "default")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if kind == "dynamic":
        factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
        seq = torch.clamp(pos + 1, min=orig)
        base = theta * ((factor * seq / orig) - (factor - 1)) ** (head_dim / (head_dim - 2))
        freqs = pos[:, None] * (1.0 / base[:, None] ** exponents)
    elif kind == "longrope":
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta ** exponents)
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta ** exponents)
        is_long = (pos + 1 > scaling["original_max_position_embeddings"])[:, None]
        freqs = pos[:, None] * torch.where(is_long, long, short)
    else:
        freqs = torch.outer(pos, rope_inv_freq(head_dim, theta, scaling))
    attn = rope_attention_factor(scaling)
    return freqs.cos() * attn, freqs.sin() * attn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout, with a precomputed cos/sin table.

    `cos_sin(positions)` is computed once per forward pass and shared by all layers; `apply` rotates q and k
    together when they are given as one [tokens, heads + kv_heads, dim] view.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        cos, sin = rope_tables(head_dim, max_positions, theta, scaling)  # [pos, dim / 2]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, 1, dim / 2] each, ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, dim] (any strides) -> rotated, contiguous. Same math as HF's
        `x * cos + rotate_half(x) * sin`, in four ops and without the concatenation."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        return out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, dim], k: [tokens, kv_heads, dim]."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)
