"""A checkpoint's quantized blocks as read, kept in their own format: GGUF's Q4_0 / Q4_1 tensors become
`Int4Blocks`, which model/quant.py's int4 layers run without dequantizing."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Int4Blocks:
    """An int4 weight in the layout `quantize_int4` produces (groups of 32): packed nibbles [N, K/2] uint8, scale
    and minimum [N, K/32] fp16, weight = q * scale + min. GGUF's Q4_1 blocks are exactly this (d, m, 16 bytes of
    nibbles, values 0..15 low, 16..31 high) and Q4_0's are too with min = -8 * scale, so a GGUF's Q4_0 / Q4_1
    weights are loaded as they are stored (`from_gguf`) rather than dequantized and quantized again."""

    qweight: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    @classmethod
    def from_gguf(cls, raw: np.ndarray, kind: str) -> "Int4Blocks":
        """`raw`: a Q4_0 / Q4_1 tensor's bytes, [rows, blocks_per_row * block_bytes] uint8."""
        rows = raw.shape[0]
        head = {"Q4_0": 2, "Q4_1": 4}[kind]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, head + 16)
        scale = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0])
        mins = (torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0]) if kind == "Q4_1"
                else scale * -8.0)
        qs = torch.from_numpy(blocks[:, :, head:].copy()).reshape(rows, -1)
        return cls(qs.contiguous(), scale.contiguous(), mins.contiguous())

    def rows(self, perm: np.ndarray) -> "Int4Blocks":
        idx = torch.from_numpy(perm)
        return Int4Blocks(self.qweight[idx].contiguous(), self.scale[idx].contiguous(), self.mins[idx].contiguous())

    @staticmethod
    def cat(parts: list["Int4Blocks"]) -> "Int4Blocks":
        return Int4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qweight", "scale", "mins")))
