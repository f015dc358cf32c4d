"""The quantized-linear kernel library (csrc/quant_linear.cpp): its entry points, its ISA builds, what it runs
natively here, and the scratch buffer of per-call dequantization."""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from pagedlm import cbuild

SOURCE = Path(__file__).parent.parent / "csrc" / "quant_linear.cpp"


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
    lib.pagedlm_int4_x16_rows.argtypes = [p, p, p, i, i, i, i, p, i, p, i]
    lib.pagedlm_gguf_q4_to_x16.argtypes = [p, i, i, i, p, i, p, p, p, i]
    lib.pagedlm_gguf_q4_k_to_x16.argtypes = [p, i, i, p, i, p, p, p, i]
    lib.pagedlm_gguf_to_x16.argtypes = [p, i, i, i, p, i, p, p, p, p, i]
    lib.pagedlm_linear_gguf.argtypes = [p, i, p, p, p, p, p, i, i, i, i]
    lib.pagedlm_dequant_gguf_x16.argtypes = [i, p, p, p, p, p, i, i, i]
    lib.pagedlm_dequant_gguf_x16_bf16.argtypes = [i, p, p, p, p, p, i, i, i]
    lib.pagedlm_gguf_x16_rows.argtypes = [i, p, p, p, p, i, i, p, i, p, i]
    lib.pagedlm_gguf_q8_0_to_int8.argtypes = [p, i, i, p, p, i]
    lib.pagedlm_amx_native.argtypes = []
    lib.pagedlm_amx_enable.argtypes = [i]
    lib.pagedlm_row_pairs.argtypes = [i]
    lib.pagedlm_row_pair_passes.argtypes = []
    lib.pagedlm_row_pair_passes.restype = ctypes.c_int64
    lib.pagedlm_q8_0_row_passes.argtypes = []
    lib.pagedlm_q8_0_row_passes.restype = ctypes.c_int64
    lib.pagedlm_amx_products.argtypes = []
    lib.pagedlm_amx_products.restype = ctypes.c_int64
    lib.pagedlm_gguf_vnni_products.argtypes = []
    lib.pagedlm_gguf_vnni_products.restype = ctypes.c_int64
    for fn in (lib.pagedlm_linear_int8, lib.pagedlm_linear_int4, lib.pagedlm_dequant_int8, lib.pagedlm_dequant_int4,
               lib.pagedlm_x16_native, lib.pagedlm_linear_int8_x16, lib.pagedlm_linear_bf16_x16,
               lib.pagedlm_bf16_x16_native, lib.pagedlm_dequant_int4_x16_bf16, lib.pagedlm_dequant_int4_x16,
               lib.pagedlm_int4_x16_rows,
               lib.pagedlm_gguf_q4_to_x16, lib.pagedlm_gguf_q4_k_to_x16, lib.pagedlm_gguf_q8_0_to_int8,
               lib.pagedlm_gguf_to_x16, lib.pagedlm_linear_gguf, lib.pagedlm_dequant_gguf_x16,
               lib.pagedlm_dequant_gguf_x16_bf16, lib.pagedlm_gguf_x16_rows, lib.pagedlm_amx_native,
               lib.pagedlm_amx_enable, lib.pagedlm_row_pairs):
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


def bf16_x16_native() -> bool:
    """Whether the kernel multiplies bf16 weights with AVX512-BF16 here (else portable code does, slowly)."""
    lib = load_quant_kernel()
    return lib is not None and bool(lib.pagedlm_bf16_x16_native())


def x16_native(bits: int) -> bool:
    """Whether the quantized kernel runs the x16 layout of `bits`-bit weights in SIMD code here (int4: AVX-512 VNNI
    or AVX2; int8: AVX-512 VNNI)."""
    lib = load_quant_kernel()
    return lib is not None and bool(lib.pagedlm_x16_native(bits))


def amx_native() -> bool:
    """Whether products of several rows over the int4 / int8 x16 layouts and GGUF Q8_0 run on AMX tiles here (the
    same results as the AVX-512 VNNI code, bit for bit)."""
    lib = load_quant_kernel()
    return lib is not None and bool(lib.pagedlm_amx_native())


_SCRATCH = threading.local()  # per thread: each served model's engine steps on a thread of its own


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of `numel` elements shared by every layer's per-call dequantization on this thread (its steps run
    one at a time; reusing it saves a fresh allocation, and its page faults, per product)."""
    bufs: dict[torch.dtype, torch.Tensor] = _SCRATCH.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]
