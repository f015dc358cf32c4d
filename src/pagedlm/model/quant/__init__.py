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

GGUF checkpoints' own blocks run as the file stores them (int4.py: Q4_0 / Q4_1 / Q4_K; gguf.py: Q8_0, Q5_0, Q5_K,
Q6_K), each kind with its own scales, so decode reads about the file's bytes and no weight is rounded twice.

Layout of this package: kernel.py (the C++ library), formats.py (formats as tensors), linear.py (the layers),
int4.py (int4 and GGUF Q4 blocks), gguf.py (GGUF's 5- to 8-bit blocks), concat.py (fused weights whose parts
mix kinds).
"""
from pagedlm.model.quant import kernel
from pagedlm.model.quant.concat import ConcatLinear
from pagedlm.model.quant.formats import (
                                         X16,
                                         bf16_from_x16,
                                         bf16_to_x16,
                                         can_pack_int8,
                                         dequantize_int4,
                                         dequantize_int8,
                                         from_x16,
                                         int8_from_x16,
                                         int8_to_x16,
                                         pack_int8,
                                         prepack_bf16,
                                         quantize_activations_q8,
                                         quantize_int4,
                                         quantize_int8,
                                         to_x16,
                                         unpack_int8,
)
from pagedlm.model.quant.gguf import GGUF_KINDS, GGUFLinear
from pagedlm.model.quant.int4 import Int4Linear
from pagedlm.model.quant.kernel import (
                                         KERNEL,
                                         SOURCE,
                                         bf16_x16_native,
                                         kernel_variant,
                                         load_quant_kernel,
                                         scratch,
                                         x16_native,
)
from pagedlm.model.quant.linear import (
                                         METHODS,
                                         Bf16Linear,
                                         Int8Linear,
                                         QuantLinear,
                                         TableEmbedding,
                                         WithBias,
                                         make_quant_linear,
)

__all__ = ["GGUF_KINDS", "KERNEL", "METHODS", "SOURCE", "X16", "Bf16Linear", "ConcatLinear", "GGUFLinear", "Int4Linear",
           "Int8Linear", "QuantLinear", "TableEmbedding", "WithBias", "bf16_from_x16", "bf16_to_x16",
           "bf16_x16_native", "can_pack_int8", "dequantize_int4", "dequantize_int8", "from_x16", "int8_from_x16",
           "int8_to_x16", "kernel", "kernel_variant", "load_quant_kernel", "make_quant_linear", "pack_int8",
           "prepack_bf16", "quantize_activations_q8", "quantize_int4", "quantize_int8", "scratch", "to_x16",
           "unpack_int8", "x16_native"]
