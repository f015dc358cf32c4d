"""The CPU paged-attention kernel (csrc/paged_attention.cpp): K/V read in place from the blocks, GQA without
repeats, decode and prefill chunks, fp32 and bf16, OpenMP over (sequence, kv head, query tile, key range).

It is plain C++ behind a C ABI, compiled on first use with the system's g++ (about a second, no torch headers,
no ninja) into `$PAGEDLM_CACHE/kernels/` and called through ctypes. `load_kernel()` returns None (and says why
in the log) where that fails; callers then fall back to the sdpa path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedlm.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]
HEAD_DIMS = (16, 32, 64, 80, 96, 128)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLM_CACHE") or Path.home() / ".cache" / "pagedlm"
    return Path(root) / "kernels"


def _cpu_key() -> str:
    """Kernels are built with -march=native: key the cache on the CPU's flags too."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return platform.machine() + flags


def build(source: Path = SOURCE) -> Path:
    """Compile `source` (if not cached) and return the shared library's path. Raises on failure."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    digest = hashlib.sha256(source.read_bytes() + " ".join([cxx, *FLAGS, _cpu_key()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"paged_attention_{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        res = subprocess.run([cxx, *FLAGS, str(source), "-o", str(tmp_out)], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never see a half-written library
    return out


@functools.lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be built or loaded (reason logged)."""
    if os.environ.get("PAGEDLM_DISABLE_CPU_KERNEL"):
        logger.info("CPU attention kernel disabled by PAGEDLM_DISABLE_CPU_KERNEL.")
        return None
    try:
        lib = ctypes.CDLL(str(build()))
        fn = lib.pagedlm_paged_attention
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                       + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
        return lib
    except Exception as e:  # noqa: BLE001 - any failure means: use the fallback
        logger.warning("CPU attention kernel unavailable (%s: %s).", type(e).__name__, str(e).splitlines()[0])
        return None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles this call (else callers use the sdpa path)."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype and dim in HEAD_DIMS
            and heads % kv_heads == 0 and heads <= 64)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Same contract as `paged_attention_reference`; falls back to the sdpa path for unsupported inputs."""
    lib = load_kernel()
    if lib is None or not supports(q, k_cache):
        from pagedlm.attention.torch_sdpa import paged_attention_sdpa
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale, sliding_window)
    q = q.contiguous()
    out = torch.empty_like(q)
    tables, seq_lens, qsl = meta.block_tables, meta.seq_lens, meta.query_start_loc
    assert tables.dtype == seq_lens.dtype == qsl.dtype == torch.int32 and tables.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    rc = lib.pagedlm_paged_attention(
        _DTYPES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), qsl.data_ptr(), meta.num_seqs,
        q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1], float(scale),
        int(sliding_window or 0), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged attention kernel failed (code {rc})")
    return out
