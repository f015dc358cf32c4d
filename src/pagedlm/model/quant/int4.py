"""Int4 weights: quantized here per group, or GGUF's Q4_0 / Q4_1 / Q4_K blocks kept as the file stores them."""
from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F

from pagedlm.hub.blocks import Int4Blocks, RawBlocks
from pagedlm.model import weight_cache
from pagedlm.model.quant import kernel
from pagedlm.model.quant.formats import X16, dequantize_int4, from_x16, quantize_activations_q8, quantize_int4, to_x16
from pagedlm.model.quant.kernel import scratch, x16_native
from pagedlm.model.quant.linear import QuantLinear


class Int4Linear(QuantLinear):
    """From a float weight [out, in] (quantized here) or from GGUF int4 blocks (`RawBlocks`, `Int4Blocks`: kept as
    they are). Stored in the kernel's x16 layout (`x16`) where it runs natively and the shape allows, else by rows.
    `layout` says how the scales are held:
    - "rows" / "x16": an fp16 scale and minimum per group (`scale`, `mins`); in the x16 layout of GGUF Q4_0 blocks
      no minimums (`mins` empty: -8 * scale, as the format defines it), so the kernel reads the file's bytes;
    - "x16_k": GGUF Q4_K's own scales, x16 codes with `scale` the super-blocks' fp16 d and dmin ([N, K/256 * 2]) and
      `mins` each block's 6-bit scale and minimum as bytes ([N, K/32 * 2], uint8): 4.6 bits a weight, and the
      scales are d * sc and -dmin * m in fp32, as llama.cpp dequantizes them. Its products take activations with
      one scale per 256 values (llama.cpp's Q8_K; `dense_input`)."""

    LAYOUTS = {"rows": 0, "x16": 1, "x16_k": 2}  # csrc's Int4Layout

    def __init__(self, weight: torch.Tensor | Int4Blocks | RawBlocks, group_size: int, x16: bool | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        self.group_size = group_size
        if isinstance(weight, (Int4Blocks, RawBlocks)) and group_size != 32:
            raise ValueError(f"int4 blocks have groups of 32, not {group_size}")
        self.x16 = (x16_native(4) if x16 is None else x16) and self.out_features % X16 == 0
        native = self.x16 and kernel.load_quant_kernel() is not None
        if isinstance(weight, RawBlocks) and native and _x16_native_kinds(weight):
            tensors, self.layout = _x16_from_gguf(weight)
        else:
            if isinstance(weight, RawBlocks):
                weight = weight.blocks()
            blocks = weight if isinstance(weight, Int4Blocks) else Int4Blocks(*quantize_int4(weight, group_size))
            tensors = (blocks.qweight, blocks.scale, blocks.mins)
            if self.x16:
                tensors = to_x16(*tensors)
            self.layout = "x16" if self.x16 else "rows"
        for name, t in zip(("qweight", "scale", "mins"), tensors):
            self.register_buffer(name, t)

    def row_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K/2], fp16 scales, minimums [N, K/G]) in the row layout (not for "x16_k": see dequantize)."""
        if self.layout == "x16_k":
            raise ValueError("Q4_K's scales have no fp16 row layout")
        mins = self.mins if self.mins.numel() else self.scale * -8.0
        return from_x16(self.qweight, self.scale, mins) if self.x16 else (self.qweight, self.scale, mins)

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_activations_q8(x, 256 if self.layout == "x16_k" else 32)

    def dequantize(self) -> torch.Tensor:
        lib = kernel.load_quant_kernel()
        if lib is None or self.qweight.device.type != "cpu":
            if self.layout == "x16_k":
                return _dequantize_q4_k_x16(self.qweight, self.scale, self.mins)
            return dequantize_int4(*self.row_layout(), self.group_size)
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        if self.x16:
            rc = lib.pagedlm_dequant_int4_x16(self.qweight.data_ptr(), self.scale.data_ptr(), _ptr(self.mins),
                                              w.data_ptr(), self.in_features, self.out_features, self.group_size,
                                              self.LAYOUTS[self.layout], torch.get_num_threads())
        else:
            rc = lib.pagedlm_dequant_int4(self.qweight.data_ptr(), self.scale.data_ptr(), self.mins.data_ptr(),
                                          w.data_ptr(), self.in_features, self.out_features, self.group_size,
                                          torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int4 dequantization failed (code {rc})")
        return w

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized to fp32 (an embedding table as stored, x16 layout)."""
        lib = kernel.load_quant_kernel()
        if lib is None or not self.x16:
            raise ValueError("an int4 table's rows are looked up in the x16 layout, with the kernels built")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        rc = lib.pagedlm_int4_x16_rows(self.qweight.data_ptr(), self.scale.data_ptr(), _ptr(self.mins),
                                       self.in_features, self.out_features, self.group_size, self.LAYOUTS[self.layout],
                                       flat.data_ptr(), flat.numel(), out.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int4 table rows failed (code {rc}): ids outside 0..{self.out_features - 1}?")
        return out.view(*ids.shape, self.in_features)

    PER_CALL_ROWS = 1024  # output rows dequantized at a time for a per-call product: they stay in L2 for the GEMM

    def dequantize_to(self, dtype: torch.dtype) -> torch.Tensor:
        if not self._bf16_dequant(dtype):
            return super().dequantize_to(dtype)
        w = scratch(self.out_features * self.in_features, dtype).view(self.out_features, self.in_features)
        return self._dequant_rows(0, self.out_features, w)

    def per_call_product(self, x: torch.Tensor) -> torch.Tensor:
        """The weight dequantized PER_CALL_ROWS output rows at a time (x16 tiles are contiguous), each slice
        multiplied while it is in the cache: 1.03-1.2x the whole weight dequantized at once at 512 rows."""
        n, chunk = self.out_features, self.PER_CALL_ROWS
        if not self._bf16_dequant(x.dtype) or n <= chunk:
            return super().per_call_product(x)
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        w = scratch(chunk * self.in_features, x.dtype).view(chunk, self.in_features)
        for n0 in range(0, n, chunk):
            rows = min(chunk, n - n0)
            y[:, n0:n0 + rows] = F.linear(x, self._dequant_rows(n0, rows, w[:rows]))
        return y

    def _bf16_dequant(self, dtype: torch.dtype) -> bool:
        return (dtype == torch.bfloat16 and self.x16 and self.qweight.device.type == "cpu"
                and kernel.load_quant_kernel() is not None)

    def _dequant_rows(self, n0: int, rows: int, out: torch.Tensor) -> torch.Tensor:
        """Output rows n0 .. n0 + rows (multiples of 16) of the x16 weight, dequantized to bf16 into `out`."""
        q, scale, mins = (t[n0:n0 + rows] for t in (self.qweight, self.scale, self.mins))
        rc = kernel.load_quant_kernel().pagedlm_dequant_int4_x16_bf16(
            q.data_ptr(), scale.data_ptr(), _ptr(mins), out.data_ptr(), self.in_features, rows, self.group_size,
            self.LAYOUTS[self.layout], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int4 dequantization failed (code {rc})")
        return out

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor) -> None:
        rc = lib.pagedlm_linear_int4(x.data_ptr(), self.qweight.data_ptr(), self.scale.data_ptr(), _ptr(self.mins),
                                     y.data_ptr(), x.shape[0], self.in_features, self.out_features, self.group_size,
                                     self.LAYOUTS[self.layout], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int4 kernel failed (code {rc})")


def _ptr(t: torch.Tensor) -> int | None:
    """A tensor's data pointer for the kernels, None (null) for an empty one (Q4_0's absent minimums)."""
    return t.data_ptr() if t.numel() else None


def _x16_native_kinds(raw: RawBlocks) -> bool:
    """Whether the kernel writes these GGUF blocks' x16 layout itself: Q4_0 / Q4_1 rows, or Q4_K rows alone."""
    return raw.kinds <= {"Q4_0", "Q4_1"} or (raw.kinds == {"Q4_K"} and raw.cols % 256 == 0)


def _x16_from_gguf(raw: RawBlocks) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], str]:
    """The x16 layout (codes, scales, minimums) of GGUF Q4_0 / Q4_1 / Q4_K rows, written by the kernel in one pass
    (or mapped from the repacked-weight cache), and its Int4Linear.layout."""
    n, k = raw.shape
    q4_k = raw.kinds == {"Q4_K"}
    if q4_k:
        specs = [((n, k // 2), torch.uint8), ((n, k // 256 * 2), torch.float16), ((n, k // 32 * 2), torch.uint8)]
    else:
        specs = [((n, k // 2), torch.uint8), ((n, k // 32), torch.float16),
                 ((0 if raw.kinds == {"Q4_0"} else n, k // 32), torch.float16)]
    layout = "x16_k" if q4_k else "x16"

    def fill(out: list[torch.Tensor]) -> None:
        codes, scales, mins = out
        row0, lib = 0, kernel.load_quant_kernel()
        for data, kind, perm in raw.parts:
            data = np.ascontiguousarray(data)
            idx = None if perm is None else np.ascontiguousarray(perm, dtype=np.int64)
            idx_ptr = None if idx is None else idx.ctypes.data
            if q4_k:
                rc = lib.pagedlm_gguf_q4_k_to_x16(data.ctypes.data, data.shape[0], k, idx_ptr, row0, codes.data_ptr(),
                                                  scales.data_ptr(), mins.data_ptr(), torch.get_num_threads())
            else:
                rc = lib.pagedlm_gguf_q4_to_x16(data.ctypes.data, {"Q4_0": 0, "Q4_1": 1}[kind], data.shape[0], k,
                                                idx_ptr, row0, codes.data_ptr(), scales.data_ptr(), _ptr(mins),
                                                torch.get_num_threads())
            if rc:
                raise RuntimeError(f"int4 repacking failed (code {rc})")
            row0 += data.shape[0]

    codes, scales, mins = weight_cache.converted(raw.source, f"int4_{layout}", specs, fill)
    raw.converted()
    return (codes, scales, mins), layout


def _dequantize_q4_k_x16(codes: torch.Tensor, dd: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """The "x16_k" layout dequantized in torch (where the kernel is not built): code * d * sc - dmin * m."""
    n, half = codes.shape
    k = half * 2
    q, _, _ = from_x16(codes, torch.zeros(n, 1), torch.zeros(n, 1))
    chunks = q.reshape(n, k // 32, 1, 16)
    values = torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(n, k // 32, 32).float()
    d = dd.view(n // X16, k // 256, 2, X16).float().permute(0, 3, 1, 2).reshape(n, k // 256, 2)
    b = sm.view(n // X16, k // 32, 2, X16).float().permute(0, 3, 1, 2).reshape(n, k // 32, 2)
    d = d.repeat_interleave(8, dim=1)
    scale, mins = d[..., 0] * b[..., 0], -(d[..., 1] * b[..., 1])
    return (values * scale[..., None] + mins[..., None]).reshape(n, k)
