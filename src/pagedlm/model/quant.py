"""Weight-only quantization of the linear layers, applied at load time from whatever the checkpoint held.

- "int8": symmetric per output channel, W = q * s (q in -127..127).
- "int4": asymmetric per group of `group_size` inputs, W = q * scale + min (q in 0..15), scale/min in fp16,
  about 5 bits per weight with groups of 32 (llama.cpp's Q4_1). Its activations are quantized on the fly per
  32-value block to int8 with one fp32 scale (as llama.cpp pairs Q4_1 with Q8_1), so the kernel reduces blocks
  with integer dot products; every path, kernel or dense fallback, computes y = Q8(x) @ W^T.

Products with few rows (decode, up to `kernel_max_rows`, at most KERNEL_MAX_ROWS) run in csrc/quant_linear.cpp,
which reads the quantized weights directly (int8 packed in tiles of 4 rows, see `pack_int8`; int4 with integer dot
products) and so streams a quarter (int8) or about a sixth (int4) of the fp32 bytes. Products with more rows
(prefill, big batches) are compute-bound: they run a dense GEMM over a copy of the dequantized weight kept beside the
quantized one (`set_dense`: bf16 where the CPU has native bf16, else fp32 with the same Q8 activations as the
kernel), or, without that copy, dequantize the whole weight per call. The tied embedding / LM head table is kept
once, in int8 per row, for both methods (as llama.cpp keeps the output matrix at higher precision than Q4): looked up
row by row, multiplied through the int8 kernel.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedlm import cbuild
from pagedlm.config import KERNEL_MAX_ROWS, QUANTIZATION_METHODS
from pagedlm.hub.blocks import Int4Blocks, LazyRows, RawInt4

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "quant_linear.cpp"
METHODS = (*QUANTIZATION_METHODS, "bf16")  # "bf16": a bf16 checkpoint's weights as stored, fp32 activations


def _configure(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.pagedlm_linear_int8.argtypes = [p, p, p, p, i, i, i, i, i]
    lib.pagedlm_linear_int4.argtypes = [p, p, p, p, p, i, i, i, i, i, i]
    lib.pagedlm_x16_native.argtypes = [ctypes.c_int]
    lib.pagedlm_linear_int8_x16.argtypes = [p, p, p, p, i, i, i, i]
    lib.pagedlm_linear_bf16_x16.argtypes = [p, p, p, i, i, i, i]
    lib.pagedlm_bf16_x16_native.argtypes = []
    lib.pagedlm_dequant_int8.argtypes = [p, p, p, i, i, i, i]
    lib.pagedlm_dequant_int4.argtypes = [p, p, p, p, i, i, i, i]
    lib.pagedlm_dequant_int4_x16_bf16.argtypes = [p, p, p, p, i, i, i, i, i]
    lib.pagedlm_dequant_int4_x16.argtypes = [p, p, p, p, i, i, i, i, i]
    lib.pagedlm_gguf_q4_to_x16.argtypes = [p, i, i, i, p, i, p, p, p, i]
    lib.pagedlm_gguf_q4_k_to_x16.argtypes = [p, i, i, p, i, p, p, p, i]
    lib.pagedlm_gguf_q8_0_to_int8.argtypes = [p, i, i, p, p, i]
    for fn in (lib.pagedlm_linear_int8, lib.pagedlm_linear_int4, lib.pagedlm_dequant_int8, lib.pagedlm_dequant_int4,
               lib.pagedlm_x16_native, lib.pagedlm_linear_int8_x16, lib.pagedlm_linear_bf16_x16,
               lib.pagedlm_bf16_x16_native, lib.pagedlm_dequant_int4_x16_bf16, lib.pagedlm_dequant_int4_x16,
               lib.pagedlm_gguf_q4_to_x16, lib.pagedlm_gguf_q4_k_to_x16, lib.pagedlm_gguf_q8_0_to_int8):
        fn.restype = ctypes.c_int


KERNEL = cbuild.KernelLibrary(SOURCE, "Quantized linear kernel", "using dequantize + GEMM", _configure)


_VARIANTS: dict[str, cbuild.KernelLibrary] = {"native": KERNEL}


def kernel_variant(march: str) -> cbuild.KernelLibrary:
    """The kernel compiled with `-march=<march>` ("native" is KERNEL; "haswell": AVX2 without VNNI; "x86-64": the
    portable code), so that tests can run every path the CPU supports."""
    return _VARIANTS.setdefault(march, cbuild.KernelLibrary(SOURCE, f"Quantized linear kernel ({march})",
                                                            "using dequantize + GEMM", _configure, march=march))


def load_quant_kernel() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built (then every product takes the dense path)."""
    return KERNEL.load()


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


def bf16_x16_native() -> bool:
    """Whether the kernel multiplies bf16 weights with AVX512-BF16 here (else portable code does, slowly)."""
    lib = load_quant_kernel()
    return lib is not None and bool(lib.pagedlm_bf16_x16_native())


def x16_native(bits: int) -> bool:
    """Whether the quantized kernel runs the x16 layout of `bits`-bit weights in SIMD code here (int4: AVX-512 VNNI
    or AVX2; int8: AVX-512 VNNI)."""
    lib = load_quant_kernel()
    return lib is not None and bool(lib.pagedlm_x16_native(bits))


def quantize_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """x [.., K] (K a multiple of 32) with each 32-value block rounded to int8 steps of max|block| / 127: the
    values the int4 kernel multiplies (same rounding: half to even of x / d)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
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


_SCRATCH = threading.local()  # per thread: each served model's engine steps on a thread of its own


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of `numel` elements shared by every layer's per-call dequantization on this thread (its steps run
    one at a time; reusing it saves a fresh allocation, and its page faults, per product)."""
    bufs: dict[torch.dtype, torch.Tensor] = _SCRATCH.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


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
        lib = load_quant_kernel()
        if lib is not None and x2.shape[0] <= self.kernel_max_rows and x2.device.type == "cpu":
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
        else:  # by rows straight into the layout (tiles of 16 / 4 rows are contiguous): no second copy of the table
            device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
            q = torch.empty(n * k, dtype=torch.int8, device=device)
            scale = torch.empty(n, dtype=torch.float32, device=device)
            for i in range(0, n, 512):
                qc, scale[i:i + 512] = _int8_rows(weight, i, i + 512)
                q[i * k:i * k + qc.numel()] = layout(qc).view(-1)
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
        lib = load_quant_kernel()
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


class Int4Linear(QuantLinear):
    """From a float weight [out, in] (quantized here) or from GGUF int4 blocks (`RawInt4`, `Int4Blocks`: kept as
    they are). Stored in the kernel's x16 layout (`x16`) where it runs natively and the shape allows, else by rows.
    `layout` says how the scales are held:
    - "rows" / "x16": an fp16 scale and minimum per group (`scale`, `mins`); in the x16 layout of GGUF Q4_0 blocks
      no minimums (`mins` empty: -8 * scale, as the format defines it), so the kernel reads the file's bytes;
    - "x16_k": GGUF Q4_K's own scales, x16 codes with `scale` the super-blocks' fp16 d and dmin ([N, K/256 * 2]) and
      `mins` each block's 6-bit scale and minimum as bytes ([N, K/32 * 2], uint8): 4.6 bits a weight, and the
      scales are d * sc and -dmin * m in fp32, as llama.cpp dequantizes them."""

    LAYOUTS = {"rows": 0, "x16": 1, "x16_k": 2}  # csrc's Int4Layout

    def __init__(self, weight: torch.Tensor | Int4Blocks | RawInt4, group_size: int, x16: bool | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0])
        self.group_size = group_size
        if isinstance(weight, (Int4Blocks, RawInt4)) and group_size != 32:
            raise ValueError(f"int4 blocks have groups of 32, not {group_size}")
        self.x16 = (x16_native(4) if x16 is None else x16) and self.out_features % X16 == 0
        if isinstance(weight, RawInt4) and self.x16 and load_quant_kernel() is not None and _x16_native_kinds(weight):
            tensors, self.layout = _x16_from_gguf(weight)
        else:
            if isinstance(weight, RawInt4):
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
        return quantize_activations_q8(x)

    def dequantize(self) -> torch.Tensor:
        lib = load_quant_kernel()
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
                and load_quant_kernel() is not None)

    def _dequant_rows(self, n0: int, rows: int, out: torch.Tensor) -> torch.Tensor:
        """Output rows n0 .. n0 + rows (multiples of 16) of the x16 weight, dequantized to bf16 into `out`."""
        q, scale, mins = (t[n0:n0 + rows] for t in (self.qweight, self.scale, self.mins))
        rc = load_quant_kernel().pagedlm_dequant_int4_x16_bf16(
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


def _x16_native_kinds(raw: RawInt4) -> bool:
    """Whether the kernel writes these GGUF blocks' x16 layout itself: Q4_0 / Q4_1 rows, or Q4_K rows alone."""
    return raw.kinds <= {"Q4_0", "Q4_1"} or (raw.kinds == {"Q4_K"} and raw.cols % 256 == 0)


def _x16_from_gguf(raw: RawInt4) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], str]:
    """The x16 layout (codes, scales, minimums) of GGUF Q4_0 / Q4_1 / Q4_K rows, written by the kernel in one pass,
    and its Int4Linear.layout."""
    n, k = raw.shape
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    q4_k = raw.kinds == {"Q4_K"}
    if q4_k:
        scales, mins = torch.empty(n, k // 256 * 2, dtype=torch.float16), torch.empty(n, k // 32 * 2, dtype=torch.uint8)
    else:
        scales = torch.empty(n, k // 32, dtype=torch.float16)
        mins = torch.empty(0 if raw.kinds == {"Q4_0"} else n, k // 32, dtype=torch.float16)
    row0, lib = 0, load_quant_kernel()
    for data, kind, perm in raw.parts:
        data = np.ascontiguousarray(data)
        idx = None if perm is None else np.ascontiguousarray(perm, dtype=np.int64)
        idx_ptr = None if idx is None else idx.ctypes.data
        if q4_k:
            rc = lib.pagedlm_gguf_q4_k_to_x16(data.ctypes.data, data.shape[0], k, idx_ptr, row0, codes.data_ptr(),
                                              scales.data_ptr(), mins.data_ptr(), torch.get_num_threads())
        else:
            rc = lib.pagedlm_gguf_q4_to_x16(data.ctypes.data, {"Q4_0": 0, "Q4_1": 1}[kind], data.shape[0], k, idx_ptr,
                                            row0, codes.data_ptr(), scales.data_ptr(), _ptr(mins),
                                            torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int4 repacking failed (code {rc})")
        row0 += data.shape[0]
    raw.converted()
    return (codes, scales, mins), "x16_k" if q4_k else "x16"


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


def _int8_rows(w: torch.Tensor | LazyRows, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows start .. stop of w quantized to int8 per row (quantize_int8); a Q8_0 GGUF table's by the kernel, which
    gives the same values from its blocks without the fp32 temporaries."""
    lib = load_quant_kernel()
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
    """An embedding table kept as an Int8Linear or a Bf16Linear ([vocab, hidden] rows): `forward(ids)` looks rows up
    (`embed`) in `dtype`; a tied LM head is that same layer, so one copy serves both."""

    def __init__(self, table: Int8Linear | Bf16Linear, dtype: torch.dtype) -> None:
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
        if isinstance(weight, (Int4Blocks, RawInt4)):
            raise ValueError("int4 blocks cannot be quantized to int8")
        return Int8Linear(weight)
    if method == "int4":
        return Int4Linear(weight, group_size)
    if method == "bf16" and not isinstance(weight, (Int4Blocks, RawInt4)):
        return Bf16Linear(weight)
    raise ValueError(f"quantization must be one of {METHODS} or None, got {method!r}")
