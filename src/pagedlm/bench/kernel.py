"""Kernel micro-benchmark: paged decode attention (K/V scattered over shuffled blocks) against torch's
`scaled_dot_product_attention` on the same K/V laid out contiguously. Both sides run alternately; medians.
`bench_builds` times several builds of the CPU kernel (another -march, an older source) alternately, the same way."""
from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedlm.attention import BACKENDS, AttentionMetadata


@dataclass
class KernelResult:
    backend: str
    dtype: str
    batch: int
    context: int
    paged_us: float
    contiguous_us: float

    @property
    def ratio(self) -> float:
        return self.paged_us / self.contiguous_us


def decode_case(batch: int, context: int, heads: int = 9, kv_heads: int = 3, dim: int = 64, block_size: int = 16,
                dtype: torch.dtype = torch.float32, seed: int = 0):
    """A decode batch (one query per sequence, all of length `context`) in a shuffled paged cache, plus the
    same K/V contiguous as [batch, kv_heads, context, dim]."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-context // block_size)
    perm = torch.randperm(batch * nb + 8, generator=g)
    tables = perm[:batch * nb].view(batch, nb).to(torch.int32)
    k = torch.randn(batch, kv_heads, context, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, context, dim, generator=g).to(dtype)
    k_cache = torch.zeros(batch * nb + 8, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pad = nb * block_size - context
    kp = F.pad(k.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(batch * nb, block_size, kv_heads, dim)
    vp = F.pad(v.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(batch * nb, block_size, kv_heads, dim)
    k_cache[tables.flatten().long()] = kp
    v_cache[tables.flatten().long()] = vp
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.long), block_tables=tables,
                             seq_lens=seq_lens, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                             seq_lens_list=[context] * batch, query_lens_list=[1] * batch, max_query_len=1,
                             max_seq_len=context, block_size=block_size)
    return q, k_cache, v_cache, meta, k, v


def bench_kernel(backend: str = "cpu", batches=(1, 16, 64), contexts=(128, 1024, 4096),
                 dtype: torch.dtype = torch.float32, repeats: int = 30) -> list[KernelResult]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(sorted(BACKENDS))}")
    fn = BACKENDS[backend].forward
    results = []
    for b in batches:
        for s in contexts:
            q, kc, vc, meta, k, v = decode_case(b, s, dtype=dtype)
            scale = q.shape[-1] ** -0.5
            qc = q.unsqueeze(2)  # [B, H, 1, D]
            paged = lambda: fn(q, kc, vc, meta, scale)  # noqa: E731
            contiguous = lambda: F.scaled_dot_product_attention(qc, k, v, scale=scale, enable_gqa=True)  # noqa: E731
            out_p, out_c = paged(), contiguous()
            torch.testing.assert_close(out_p.float(), out_c.squeeze(2).float(), atol=2e-2, rtol=2e-2)
            tp, tc = [], []
            reps = max(3, min(repeats, int(repeats * 1024 * 16 / (b * s)) + 3))
            for _ in range(reps):  # alternate so that machine noise hits both sides alike
                for fn_, times in ((paged, tp), (contiguous, tc)):
                    t0 = time.perf_counter()
                    fn_()
                    times.append(time.perf_counter() - t0)
            results.append(KernelResult(backend, str(dtype).removeprefix("torch."), b, s,
                                        statistics.median(tp) * 1e6, statistics.median(tc) * 1e6))
    return results


def format_kernel(results: list[KernelResult]) -> str:
    lines = [f"{'backend':>8} {'dtype':>8} {'batch':>5} {'context':>7} {'paged us':>10} {'sdpa-contig us':>14} "
             f"{'ratio':>6}"]
    for r in results:
        lines.append(f"{r.backend:>8} {r.dtype:>8} {r.batch:>5} {r.context:>7} {r.paged_us:>10.1f} "
                     f"{r.contiguous_us:>14.1f} {r.ratio:>6.2f}")
    return "\n".join(lines)


def to_json(results: list[KernelResult]) -> list[dict]:
    return [{**asdict(r), "ratio": r.ratio} for r in results]


@dataclass
class BuildsResult:
    kv_dtype: str
    batch: int
    context: int
    us: dict[str, float]  # build name -> median microseconds


def bench_builds(builds: dict[str, ctypes.CDLL], cases=((64, 160), (1, 1024), (1, 4096)),
                 kv_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
                 repeats: int = 60) -> list[BuildsResult]:
    """Decode attention (fp32 queries, 9 heads over 3 kv heads, head_dim 64) through each loaded build of the CPU
    kernel (cpu_kernel.kernel_variant(...).load(), or a library of another source with the same entry point),
    the builds called in turn on the same batch; they must agree. Medians per build."""
    from pagedlm.attention.cpu_kernel import paged_attention_cpu

    results = []
    for kv_dtype in kv_dtypes:
        for batch, context in cases:
            q, kc, vc, meta, _, _ = decode_case(batch, context)
            kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
            outs = {name: paged_attention_cpu(q, kc, vc, meta, 0.125, lib=lib) for name, lib in builds.items()}
            first = next(iter(outs.values()))
            for out in outs.values():
                torch.testing.assert_close(out, first, atol=1e-5, rtol=1e-4)
            times: dict[str, list[float]] = {name: [] for name in builds}
            reps = max(5, min(4 * repeats, int(repeats * 64 * 160 / (batch * context))))
            for _ in range(reps):
                for name, lib in builds.items():
                    t0 = time.perf_counter()
                    paged_attention_cpu(q, kc, vc, meta, 0.125, lib=lib)
                    times[name].append(time.perf_counter() - t0)
            results.append(BuildsResult(str(kv_dtype).removeprefix("torch."), batch, context,
                                        {name: statistics.median(t) * 1e6 for name, t in times.items()}))
    return results


def format_builds(results: list[BuildsResult]) -> str:
    """One line per case: each build's median and its ratio to the first build's (first / this)."""
    lines = []
    for r in results:
        base = next(iter(r.us.values()))
        cols = "  ".join(f"{name} {us:9.1f} us ({base / us:4.2f}x)" for name, us in r.us.items())
        lines.append(f"kv {r.kv_dtype:>8} batch {r.batch:>3} context {r.context:>5}: {cols}")
    return "\n".join(lines)


def random_gguf_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid GGUF blocks of `kind` for a [rows, cols] weight: every code and 6-bit scale drawn at random (gguf-py
    cannot quantize the K-quants), the fp16 factors small and positive."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, Q[kind])
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    small = (rng.random((rows, cols // block, 2)) * 0.004 + 1e-4).astype(np.float16).view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin (fp16) lead the super-block
        raw[..., 0:4] = small
    elif kind in ("Q6_K", "Q3_K"):  # d (fp16) ends it
        raw[..., size - 2:size] = small[..., 0:2]
    elif kind == "Q2_K":  # d, dmin (fp16) end it
        raw[..., size - 4:size] = small
    elif kind in ("IQ4_NL", "IQ4_XS"):  # d (fp16) leads it
        raw[..., 0:2] = small[..., 0:2]
    return raw.reshape(rows, -1)
