"""The CPU paged-attention kernel (csrc/paged_attention.cpp): K/V read in place from the blocks, GQA without
repeats, decode and prefill chunks, fp32 and bf16, OpenMP over (sequence, kv head, query tile, key range).

It is plain C++ behind a C ABI, compiled on first use with the system's g++ (about a second, no torch headers,
no ninja) into the kernel cache (cbuild.py) and called through ctypes. `load_kernel()` returns None (and says why
in the log) where that fails; callers then fall back to the sdpa path. The kernels range-check the batch before
touching the cache: a block id or slot outside it raises ValueError, with nothing read out of range or written.
The inner loop is compiled for the build's ISA (-march=native): AVX-512, AVX2 + FMA or portable C++;
`kernel_variant(march)` builds the others this CPU can run, and `attention_isa(lib)` says which a build has.

`CpuKernelBackend` is the attention backend built on it, and the one backend the fused decoder stack
(model/llama_decode.py, which compiles the same attention code in) may stand in for.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagedlm import cbuild
from pagedlm.attention.backend import AttentionBackend
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.kvcache.format import KV_KINDS, entry_dim, is_quantized

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _configure(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.pagedlm_paged_attention.argtypes = [i, i, p, p, p, p, p, i, p, p, i, i, i, i, i, i, i, ctypes.c_float, i, i]
    lib.pagedlm_rope_write_kv.argtypes = [p, p, p, i, i, i, i, p, p, p, ctypes.c_int64, i]
    lib.pagedlm_paged_attention.restype = lib.pagedlm_rope_write_kv.restype = i
    lib.pagedlm_attention_isa.argtypes, lib.pagedlm_attention_isa.restype = [], i
    lib.pagedlm_attention_bf16_dot.argtypes, lib.pagedlm_attention_bf16_dot.restype = [], i


KERNEL = cbuild.KernelLibrary(SOURCE, "CPU attention kernel", "attention runs on the sdpa path", _configure)
_VARIANTS = {"native": KERNEL}

# What pagedlm_attention_isa() says a build's inner loop is.
ISA_AVX512, ISA_AVX2, ISA_PORTABLE = 512, 256, 0


def kernel_variant(march: str) -> cbuild.KernelLibrary:
    """The kernel compiled with `-march=<march>` ("native" is KERNEL): "haswell" builds the AVX2 + FMA path and
    "x86-64" the portable one, so that tests can run every path the CPU supports."""
    return _VARIANTS.setdefault(march, cbuild.KernelLibrary(SOURCE, f"CPU attention kernel ({march})",
                                                            "attention runs on the sdpa path", _configure,
                                                            march=march))


def attention_isa(lib: ctypes.CDLL) -> int:
    """The inner loop a loaded build compiled: ISA_AVX512, ISA_AVX2 or ISA_PORTABLE."""
    return lib.pagedlm_attention_isa()


def attention_bf16_dot(lib: ctypes.CDLL) -> bool:
    """Whether a loaded build reads bf16 caches in place with vdpbf16ps (AVX512-BF16; head_dim a multiple of 32)
    rather than converting each tile to fp32."""
    return bool(lib.pagedlm_attention_bf16_dot())


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be built or loaded (reason logged)."""
    return KERNEL.load()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles this call (else callers use the sdpa path)."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    cache_ok = ((k_cache.dtype in (q.dtype, torch.bfloat16, torch.float16) or is_quantized(k_cache.dtype))
                and k_cache.shape[3] == entry_dim(dim, k_cache.dtype))
    return (q.device.type == "cpu" and q.dtype in _DTYPES and cache_ok and dim in HEAD_DIMS
            and heads % kv_heads == 0 and heads <= 64)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int | None = None, *,
                        lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Same contract as `paged_attention_reference`; falls back to the sdpa path for unsupported inputs. `lib`: a
    loaded build to run (a kernel_variant's), else load_kernel()'s."""
    lib = lib or load_kernel()
    if lib is None or not supports(q, k_cache):
        from pagedlm.attention.torch_sdpa import paged_attention_sdpa
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale, sliding_window)
    q = q.contiguous()
    out = torch.empty_like(q)
    tokens, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    tables, seq_lens, qsl = meta.block_tables, meta.seq_lens, meta.query_start_loc
    num_seqs, width = tables.shape
    if not (tables.dtype == seq_lens.dtype == qsl.dtype == torch.int32 and tables.is_contiguous()
            and seq_lens.is_contiguous() and qsl.is_contiguous() and seq_lens.numel() == qsl.numel() - 1 == num_seqs
            and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
            and v_cache.numel() == k_cache.numel()):
        raise ValueError("paged attention kernel: block tables, seq_lens and query_start_loc must be contiguous "
                         "int32 for the same sequences, and the K and V caches contiguous and alike")
    rc = lib.pagedlm_paged_attention(
        _DTYPES[q.dtype], KV_KINDS[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        out.data_ptr(), tables.data_ptr(), width, seq_lens.data_ptr(), qsl.data_ptr(), num_seqs, tokens, heads,
        kv_heads, dim, block_size, num_blocks, float(scale), int(sliding_window or 0), torch.get_num_threads())
    if rc:
        raise cbuild.kernel_error(rc, f"paged attention kernel ({num_blocks} KV blocks)")
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Rotate q and k of a fused fp32 `qkv` [tokens, (H + 2 KVH) * D] in place (cos/sin: [tokens, 1, D/2]) and
    write k, v into an fp32 paged cache, in one kernel call. Returns False (and does nothing) where the compiled
    kernel or these layouts are unavailable; the caller then takes the torch path. A slot outside the cache raises
    ValueError, with nothing changed."""
    lib = load_kernel()
    if (lib is None or qkv.device.type != "cpu" or qkv.dtype != torch.float32 or k_cache.dtype != torch.float32
            or v_cache.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or slot_mapping.dtype != torch.int64
            or not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous()
                    and v_cache.is_contiguous() and slot_mapping.is_contiguous())):
        return False
    num_blocks, block_size, kv_heads, dim = k_cache.shape
    tokens = slot_mapping.numel()
    if (kv_heads != num_kv_heads or v_cache.numel() != k_cache.numel()
            or qkv.numel() != tokens * (num_heads + 2 * kv_heads) * dim
            or not cos.numel() == sin.numel() == tokens * (dim // 2)):
        return False
    rc = lib.pagedlm_rope_write_kv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, num_heads, kv_heads, dim,
                                   slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   num_blocks * block_size, torch.get_num_threads())
    if rc:
        raise cbuild.kernel_error(rc, f"RoPE + KV write kernel ({num_blocks * block_size} slots)")
    return True


class CpuKernelBackend(AttentionBackend):
    """`paged_attention_cpu` (the sdpa path for what the kernel does not take); the fused decoder stack may
    stand in for it."""

    name = "cpu"
    supports_fused_decode = True

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        return paged_attention_cpu(q, k_cache, v_cache, meta, scale, sliding_window)
