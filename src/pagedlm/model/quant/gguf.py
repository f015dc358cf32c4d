"""GGUF's 2- to 8-bit block formats but Q4_0/Q4_1/Q4_K (int4.py's) run as the file stores them (Q8_0, Q5_0, Q5_K,
Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS): the x16 layouts of csrc/gguf_x16.h, written in one pass from the file's rows,
multiplied by its kernel against Q8 activations, so a weight is never rounded a second time and decode reads about
the file's bytes (Q6_K 6.56 bits a weight, Q3_K 3.56, IQ4_XS 4.31; not int8's 8)."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagedlm.hub.blocks import RawBlocks
from pagedlm.model import weight_cache
from pagedlm.model.quant import kernel
from pagedlm.model.quant.formats import X16, quantize_activations_q8
from pagedlm.model.quant.kernel import scratch
from pagedlm.model.quant.linear import QuantLinear

GGUF_KINDS = {"Q8_0": 0, "Q5_0": 1, "Q5_K": 2, "Q6_K": 3, "Q3_K": 4, "IQ4_NL": 5, "IQ4_XS": 6,
              "Q2_K": 7}  # csrc's GgufKind
_SUPER = ("Q5_K", "Q6_K", "Q3_K", "IQ4_XS", "Q2_K")  # super-blocks of 256 values


def _sizes(kind: str, n: int, k: int) -> dict[str, tuple[int, torch.dtype]]:
    """Elements and dtype of each buffer of an [n, k] weight (see gguf_x16.h)."""
    blocks = n * k // 32
    return {"qweight": (blocks * {"Q8_0": 32, "Q3_K": 8, "Q2_K": 8}.get(kind, 16), torch.uint8),
            "planes": (blocks * {"Q5_0": 4, "Q5_K": 4, "Q6_K": 8, "Q3_K": 4}.get(kind, 0), torch.uint8),
            "scale": ({"Q5_K": blocks // 4, "Q6_K": blocks // 8, "Q3_K": blocks // 8, "IQ4_XS": blocks // 8,
                       "Q2_K": blocks // 4}.get(kind, blocks), torch.float16),
            "aux": (blocks * {"IQ4_XS": 1, "Q2_K": 4}.get(kind, 2) if kind in _SUPER else 0, torch.uint8)}


def layout_bytes(kind: str, n: int, k: int) -> int:
    """Bytes of an [n, k] weight of `kind` in its x16 layout (Q3_K's 114 a super-block against the file's 110)."""
    return sum(numel * dtype.itemsize for numel, dtype in _sizes(kind, n, k).values())


class GGUFLinear(QuantLinear):
    """A GGUF Q8_0 / Q5_0 / Q5_K / Q6_K / Q3_K / Q2_K / IQ4_NL / IQ4_XS weight [out, in] in its x16 layout (`supports`
    says where one can be built): `qweight` the codes' low bits (Q8_0: the int8 codes; IQ4: the level indices),
    `planes` their high bits, `scale` the fp16 factors, `aux` the K-quants' per-block scale bytes."""

    def __init__(self, weight: RawBlocks) -> None:
        if not self.supports(weight):
            raise ValueError(f"no x16 layout for GGUF {sorted(weight.kinds)} of shape {weight.shape}")
        n, k = weight.shape
        super().__init__(k, n)
        (self.kind,) = weight.kinds
        sizes = _sizes(self.kind, n, k)

        def fill(out: list[torch.Tensor]) -> None:
            out[1].zero_()  # the high-bit planes are or-ed in
            lib, row0 = kernel.load_quant_kernel(), 0
            pointers = tuple(t.data_ptr() if t.numel() else None for t in out)
            for data, _, perm in weight.parts:
                data = np.ascontiguousarray(data)
                idx = None if perm is None else np.ascontiguousarray(perm, dtype=np.int64)
                rc = lib.pagedlm_gguf_to_x16(data.ctypes.data, GGUF_KINDS[self.kind], data.shape[0], k,
                                             None if idx is None else idx.ctypes.data, row0, *pointers,
                                             torch.get_num_threads())
                if rc:
                    raise RuntimeError(f"GGUF {self.kind} repacking failed (code {rc})")
                row0 += data.shape[0]

        buffers = weight_cache.converted(weight.source, "gguf_x16", [((numel,), dtype) for numel, dtype in
                                                                     sizes.values()], fill)
        for name, buf in zip(sizes, buffers):
            self.register_buffer(name, buf)
        weight.converted()

    @staticmethod
    def supports(weight: RawBlocks) -> bool:
        """One kind of GGUF_KINDS (a fused weight of several kinds has no single layout), whole tiles of 16 rows, and
        the kernel built with SIMD code for x16 layouts (its portable build would be slower than int8)."""
        n, k = weight.shape
        if len(weight.kinds) != 1 or not weight.kinds <= GGUF_KINDS.keys():
            return False
        (kind,) = weight.kinds
        return n % X16 == 0 and k % (256 if kind in _SUPER else 32) == 0 and kernel.x16_native(4)

    def _pointers(self) -> tuple[int | None, ...]:
        return tuple(t.data_ptr() if t.numel() else None for t in (self.qweight, self.planes, self.scale, self.aux))

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_activations_q8(x, 256 if self.kind in _SUPER else 32)  # the K-quants: as llama.cpp's Q8_K

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized to fp32 (the table of a `TableEmbedding`)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        codes, planes, scale, aux = self._pointers()
        rc = kernel.load_quant_kernel().pagedlm_gguf_x16_rows(GGUF_KINDS[self.kind], codes, planes, scale, aux,
                                                             self.in_features, self.out_features, flat.data_ptr(),
                                                             flat.numel(), out.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"GGUF {self.kind} rows failed (code {rc}): ids outside 0..{self.out_features - 1}")
        return out.view(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        self._dequant(kernel.load_quant_kernel().pagedlm_dequant_gguf_x16, w)
        return w

    def dequantize_to(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype != torch.bfloat16:
            return super().dequantize_to(dtype)
        w = scratch(self.out_features * self.in_features, dtype).view(self.out_features, self.in_features)
        self._dequant(kernel.load_quant_kernel().pagedlm_dequant_gguf_x16_bf16, w)
        return w

    def _dequant(self, fn, w: torch.Tensor) -> None:
        rc = fn(GGUF_KINDS[self.kind], *self._pointers(), w.data_ptr(), self.in_features, self.out_features,
                torch.get_num_threads())
        if rc:
            raise RuntimeError(f"GGUF {self.kind} dequantization failed (code {rc})")

    def _kernel(self, lib: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor) -> None:
        codes, planes, scale, aux = self._pointers()
        rc = lib.pagedlm_linear_gguf(x.data_ptr(), GGUF_KINDS[self.kind], codes, planes, scale, aux, y.data_ptr(),
                                     x.shape[0], self.in_features, self.out_features, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"GGUF {self.kind} kernel failed (code {rc})")
