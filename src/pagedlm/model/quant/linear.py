"""The quantized linear layers: `QuantLinear` (the common forward: the kernel for small products, a dense copy or a
per-call dequantization for big ones), int8 and bf16 weights, the tied embedding / LM head table, and
`make_quant_linear`. Int4 and GGUF block layers live in int4.py and gguf.py."""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.config import KERNEL_MAX_ROWS, QUANTIZATION_METHODS
from pagedlm.hub.blocks import Int4Blocks, LazyRows, RawBlocks
from pagedlm.model import weight_cache
from pagedlm.model.quant import kernel
from pagedlm.model.quant.formats import (
    X16,
    bf16_from_x16,
    bf16_to_x16,
    can_pack_int8,
    dequantize_int8,
    int8_from_x16,
    int8_to_x16,
    pack_int8,
    prepack_bf16,
    quantize_activations_q8,
    quantize_int8,
    unpack_int8,
)
from pagedlm.model.quant.kernel import x16_native
from pagedlm.model.step_rows import path_rows

METHODS = (*QUANTIZATION_METHODS, "bf16")  # "bf16": a bf16 checkpoint's weights as stored, fp32 activations

class QuantLinear(nn.Module):
    """Drop-in for layers.Linear ([*, in] -> [*, out]) over a quantized weight; see the module docstring."""

    kernel_max_rows = KERNEL_MAX_ROWS

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dense: torch.Tensor | None = None  # see set_dense
        self.dense_transposed = False
        self.dense_packed = False  # dense is a oneDNN-blocked bf16 weight (prepack_bf16)
        self.per_call_dtype: torch.dtype | None = None  # see set_dense

    def set_dense(self, dtype: torch.dtype | None, copy: bool = True) -> None:
        """How products with more than `kernel_max_rows` rows run: over a dense copy of the dequantized weight in
        `dtype` kept in the layout layers.Linear would use (`copy`), or over the weight dequantized to `dtype` per
        call into a shared scratch buffer (no memory held: for models whose dense copy would not fit); None: per
        call in fp32 over the kernel's quantized activations."""
        from pagedlm.model.layers import prefer_transposed

        self.dense, self.dense_packed, self.per_call_dtype = None, False, None
        if dtype is None:
            return
        if not copy:
            self.per_call_dtype = dtype
            return
        w = self.dequantize().to(dtype)
        if (packed := prepack_bf16(w)) is not None:
            self.dense, self.dense_packed, self.dense_transposed = packed, True, False
            return
        self.dense_transposed = prefer_transposed(dtype, w.device)
        self.dense = w.t().contiguous() if self.dense_transposed else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features)
        lib = kernel.load_quant_kernel()
        if lib is not None and path_rows(x2.shape[0]) <= self.kernel_max_rows and x2.device.type == "cpu":
            x2 = x2.float().contiguous()
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            self._kernel(lib, x2, y)
        elif self.dense is not None:
            w = self.dense  # activations as they are: rounding them as the kernel does would cost ~15% of a step
            xin = x2.to(w.dtype)
            if self.dense_packed:
                y = torch.ops.mkldnn._linear_pointwise(xin.contiguous(), w, None, "none", [], "")
            else:
                y = xin @ w if self.dense_transposed else F.linear(xin, w)
        elif self.per_call_dtype is not None:
            y = self.per_call_product(x2.to(self.per_call_dtype))
        else:
            y = F.linear(self.dense_input(x2.float()), self.dequantize())
        return y.to(dtype).reshape(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_to(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [N, K] in `dtype`, possibly in the shared scratch buffer (valid until the next
        call of any layer's)."""
        return self.dequantize().to(dtype)

    def per_call_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with W dequantized to x's dtype for this call (see set_dense)."""
        return F.linear(x, self.dequantize_to(x.dtype))

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        """The activations as the kernel multiplies them (identity unless it quantizes them)."""
        return x

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError


class Int8Linear(QuantLinear):
    """`qweight` is [N, K]: in the kernel's x16 layout (`x16`, see `int8_to_x16`) where it runs natively and the
    shape allows, else packed ([N/4, K/16, 4, 16], see `pack_int8`) where the shape allows, else plain. The x16
    kernel multiplies Q8 activations (as the int4 kernel does); the others fp32 ones."""

    def __init__(self, weight: torch.Tensor | LazyRows, x16: bool | None = None) -> None:
        n, k = weight.shape
        super().__init__(k, n)
        self.x16 = (x16_native(8) if x16 is None else x16) and n % X16 == 0 and k % 32 == 0
        self.packed = not self.x16 and can_pack_int8(n, k)
        layout = int8_to_x16 if self.x16 else pack_int8 if self.packed else None
        if layout is None:
            q, scale = quantize_int8(weight)
        elif isinstance(weight, LazyRows):  # a GGUF table: requantized once, then mapped from the cache
            def fill(out: list[torch.Tensor]) -> None:
                _int8_into(weight, layout, *out)

            q, scale = weight_cache.converted(weight.source, "int8_x16" if self.x16 else "int8_packed",
                                              [((n * k,), torch.int8), ((n,), torch.float32)], fill)
            q = q.view(n, k) if self.x16 else q.view(n // 4, k // 16, 4, 16)
        else:
            q = torch.empty(n * k, dtype=torch.int8, device=weight.device)
            scale = torch.empty(n, dtype=torch.float32, device=weight.device)
            _int8_into(weight, layout, q, scale)
            q = q.view(n, k) if self.x16 else q.view(n // 4, k // 16, 4, 16)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized to fp32 (the table of a `TableEmbedding`)."""
        return self.rows(ids).float() * self.scale[ids, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 rows `ids` ([*ids.shape, K]), whatever the layout."""
        if self.x16:
            q = self.qweight.view(self.out_features // X16, self.in_features // 32, 8, X16, 4)
            return q[ids // X16, :, :, ids % X16, :].reshape(*ids.shape, self.in_features)
        if not self.packed:
            return self.qweight[ids]
        return self.qweight[ids // 4, :, ids % 4, :].reshape(*ids.shape, self.in_features)

    def row_layout(self) -> torch.Tensor:
        """The int8 values [N, K] by rows, whatever the stored layout."""
        if self.x16:
            return int8_from_x16(self.qweight)
        return unpack_int8(self.qweight) if self.packed else self.qweight

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_activations_q8(x) if self.x16 else x

    def dequantize(self) -> torch.Tensor:
        lib = kernel.load_quant_kernel()
        if self.x16 or lib is None or self.qweight.device.type != "cpu":
            return dequantize_int8(self.row_layout(), self.scale)
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        lib.pagedlm_dequant_int8(self.qweight.data_ptr(), self.scale.data_ptr(), w.data_ptr(), self.in_features,
                                 self.out_features, int(self.packed), torch.get_num_threads())
        return w

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.x16:
            rc = lib.pagedlm_linear_int8_x16(x.data_ptr(), self.qweight.data_ptr(), self.scale.data_ptr(),
                                             y.data_ptr(), x.shape[0], self.in_features, self.out_features,
                                             torch.get_num_threads())
            if rc:
                raise RuntimeError(f"int8 kernel failed (code {rc})")
            return
        lib.pagedlm_linear_int8(x.data_ptr(), self.qweight.data_ptr(), self.scale.data_ptr(), y.data_ptr(),
                                x.shape[0], self.in_features, self.out_features, int(self.packed),
                                torch.get_num_threads())


def _int8_into(w: torch.Tensor | LazyRows, layout: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor,
               scale: torch.Tensor) -> None:
    """w quantized to int8 per row into `q` ([N * K], in `layout`) and `scale`, by rows straight into the layout
    (tiles of 16 / 4 rows are contiguous): no second copy of the table."""
    n, k = w.shape
    for i in range(0, n, 512):
        qc, scale[i:i + 512] = _int8_rows(w, i, i + 512)
        q[i * k:i * k + qc.numel()] = layout(qc).view(-1)


def _int8_rows(w: torch.Tensor | LazyRows, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows start .. stop of w quantized to int8 per row (quantize_int8); a Q8_0 GGUF table's by the kernel, which
    gives the same values from its blocks without the fp32 temporaries."""
    lib = kernel.load_quant_kernel()
    if not (isinstance(w, LazyRows) and w.tensor.tensor_type.name == "Q8_0" and lib is not None):
        return quantize_int8(w[start:stop])
    stop = min(stop, w.shape[0])
    data = np.ascontiguousarray(w.tensor.data[start:stop])
    q = torch.empty(stop - start, w.shape[1], dtype=torch.int8)
    s = torch.empty(stop - start, dtype=torch.float32)
    if lib.pagedlm_gguf_q8_0_to_int8(data.ctypes.data, stop - start, w.shape[1], q.data_ptr(), s.data_ptr(),
                                     torch.get_num_threads()):
        raise RuntimeError("int8 requantization failed")
    w.release(start, stop)
    return q, s


class Bf16Linear(QuantLinear):
    """bf16 weights (a bf16 checkpoint's, as stored; others rounded to nearest even) with fp32 activations and
    outputs: the kernel rounds the activations to bf16 and sums the exact products in fp32 (y = bf16(x) @ W^T), as a
    bf16 GEMM does, while everything around the products (residual stream, norms, attention) stays fp32. `qweight`
    is in the x16 layout (`bf16_to_x16`) where the shape allows (N % 16 == 0, K % 32 == 0), else by rows (then
    products run through torch)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        w = weight.detach().to(torch.bfloat16).contiguous()
        n, k = w.shape
        self.x16 = n % X16 == 0 and k % 32 == 0
        self.register_buffer("qweight", bf16_to_x16(w) if self.x16 else w)

    def row_layout(self) -> torch.Tensor:
        """The bf16 weight [N, K] by rows."""
        return bf16_from_x16(self.qweight) if self.x16 else self.qweight

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The bf16 rows `ids` ([*ids.shape, K]), whatever the layout."""
        if not self.x16:
            return self.qweight[ids]
        q = self.qweight.view(self.out_features // X16, self.in_features // 2, X16, 2)
        return q[ids // X16, :, ids % X16, :].reshape(*ids.shape, self.in_features)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids).float()

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float()

    def dequantize(self) -> torch.Tensor:
        return self.row_layout().float()

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor) -> None:
        if not self.x16:
            y.copy_(F.linear(x.to(torch.bfloat16), self.qweight))
            return
        rc = lib.pagedlm_linear_bf16_x16(x.data_ptr(), self.qweight.data_ptr(), y.data_ptr(), x.shape[0],
                                         self.in_features, self.out_features, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"bf16 kernel failed (code {rc})")


class TableEmbedding(nn.Module):
    """An embedding table kept as a quantized layer with rows to look up (`embed`: Int8Linear, Bf16Linear, or a GGUF
    table as stored, GGUFLinear) ([vocab, hidden] rows): `forward(ids)` looks rows up in `dtype`; a tied LM head is
    that same layer, so one copy serves both."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.embed(ids).to(self.dtype)


class WithBias(nn.Module):
    """A quantized linear layer plus the (unquantized) bias of the Linear it replaced."""

    def __init__(self, linear: QuantLinear, bias: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.bias = nn.Parameter(bias.data, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.bias


def make_quant_linear(weight: torch.Tensor | Int4Blocks, method: str, group_size: int) -> QuantLinear:
    """`weight` is [out, in] (or int4 blocks, for int4)."""
    if method == "int8":
        if isinstance(weight, (Int4Blocks, RawBlocks)):
            raise ValueError("int4 blocks cannot be quantized to int8")
        return Int8Linear(weight)
    if method == "int4":
        from pagedlm.model.quant.int4 import Int4Linear

        return Int4Linear(weight, group_size)
    if method == "bf16" and not isinstance(weight, (Int4Blocks, RawBlocks)):
        return Bf16Linear(weight)
    raise ValueError(f"quantization must be one of {METHODS} or None, got {method!r}")
