"""Paged attention backends against plain dense causal attention on scattered block tables."""
from __future__ import annotations

import pytest
import torch

from pagedlm import cbuild
from pagedlm.attention import BACKENDS, AttentionMetadata, write_kv


def dense_attention(q, k, v, scale, window=None):
    """q: [Lq, H, D], k/v: [S, KVH, D]; q holds the last Lq positions of S. Repeats K/V for GQA."""
    lq, h, _ = q.shape
    s = k.shape[0]
    g = h // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k.double()) * scale
    qpos = torch.arange(s - lq, s)[:, None]
    kpos = torch.arange(s)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v.double())


def build_case(seq_lens, query_lens, heads, kv_heads, dim, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = need + 7
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, shuffled physical blocks
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    tables, ks, vs, qs, slots = [], [], [], [], []
    for s, lq in zip(seq_lens, query_lens):
        nb = -(-s // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(s, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(s, kv_heads, dim, generator=g).to(dtype)
        # context tokens were written in earlier steps; the last lq are written now via slot mapping
        for p in range(s - lq):
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s - lq, s)]
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(lq, heads, dim, generator=g).to(dtype))
    max_nb = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (max_nb - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots), bt, torch.tensor(seq_lens, dtype=torch.int32), cu,
                             list(seq_lens), list(query_lens), max(query_lens), max(seq_lens), block_size)
    k_new = torch.cat([k[s - lq:] for k, s, lq in zip(ks, seq_lens, query_lens)])
    v_new = torch.cat([v[s - lq:] for v, s, lq in zip(vs, seq_lens, query_lens)])
    write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    return torch.cat(qs), ks, vs, k_cache, v_cache, meta


CASES = [
    # (seq_lens, query_lens): pure prefill, pure decode, mixed chunked prefill + decode
    ([5, 17, 33], [5, 17, 33]),
    ([1, 16, 40, 129], [1, 1, 1, 1]),
    ([70, 9, 33, 200], [6, 1, 33, 1]),
]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("seq_lens,query_lens", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_matches_dense(backend, seq_lens, query_lens, heads, kv_heads, block_size):
    dim = 32
    q, ks, vs, kc, vc, meta = build_case(seq_lens, query_lens, heads, kv_heads, dim, block_size, torch.float32)
    out = BACKENDS[backend].forward(q, kc, vc, meta, dim ** -0.5)
    start = 0
    for k, v, s, lq in zip(ks, vs, seq_lens, query_lens):
        ref = dense_attention(q[start:start + lq], k, v, dim ** -0.5)
        torch.testing.assert_close(out[start:start + lq].double(), ref, atol=2e-5, rtol=1e-4)
        start += lq


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sliding_window(backend):
    dim, window = 16, 8
    seq_lens, query_lens = [30, 12, 25], [1, 12, 5]
    q, ks, vs, kc, vc, meta = build_case(seq_lens, query_lens, 4, 2, dim, 4, torch.float32, seed=3)
    out = BACKENDS[backend].forward(q, kc, vc, meta, dim ** -0.5, sliding_window=window)
    start = 0
    for k, v, s, lq in zip(ks, vs, seq_lens, query_lens):
        ref = dense_attention(q[start:start + lq], k, v, dim ** -0.5, window)
        torch.testing.assert_close(out[start:start + lq].double(), ref, atol=2e-5, rtol=1e-4)
        start += lq


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("threads", [1, 2])
def test_sliding_window_never_reads_freed_blocks(backend, threads):
    """Blocks wholly before the first query's window may be freed and their table entries point anywhere:
    here at a block full of NaN. Decode, prefill chunks and split key ranges (long batch-1 decode)."""
    dim, window, bs = 16, 8, 4
    cases = [([30, 12, 25, 63], [1, 12, 5, 9]), ([700], [1])]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seq_lens, query_lens in cases:
            q, ks, vs, kc, vc, meta = build_case(seq_lens, query_lens, 4, 2, dim, bs, torch.float32, seed=3)
            expected = BACKENDS[backend].forward(q, kc, vc, meta, dim ** -0.5, sliding_window=window)
            poison = torch.full_like(kc[:1], float("nan"))
            kc, vc = torch.cat([kc, poison]), torch.cat([vc, poison])
            for i, (s, lq) in enumerate(zip(seq_lens, query_lens)):
                first_live = max(0, s - lq - window + 1) // bs
                meta.block_tables[i, :first_live] = kc.shape[0] - 1
            out = BACKENDS[backend].forward(q, kc, vc, meta, dim ** -0.5, sliding_window=window)
            assert not out.isnan().any()
            torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
            start = 0
            for k, v, s, lq in zip(ks, vs, seq_lens, query_lens):
                ref = dense_attention(q[start:start + lq], k, v, dim ** -0.5, window)
                torch.testing.assert_close(out[start:start + lq].double(), ref, atol=2e-5, rtol=1e-4)
                start += lq
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_bf16(backend):
    dim = 64
    q, ks, vs, kc, vc, meta = build_case([50, 7], [1, 7], 6, 2, dim, 16, torch.bfloat16, seed=1)
    out = BACKENDS[backend].forward(q, kc, vc, meta, dim ** -0.5)
    ref0 = dense_attention(q[:1].float(), ks[0].float(), vs[0].float(), dim ** -0.5)
    torch.testing.assert_close(out[:1].double(), ref0, atol=2e-2, rtol=2e-2)


# ---- the compiled CPU kernel ---------------------------------------------------------------------------------

def test_cpu_kernel_builds():
    """Where a C++ compiler exists (the set-up's machines), the fast path must load, not silently fall back."""
    import shutil

    from pagedlm.attention import get_attention_backend
    from pagedlm.attention.cpu_kernel import CpuKernelBackend, load_kernel
    if shutil.which("g++") is None:
        pytest.skip("no g++ here: the kernel falls back to sdpa")
    assert load_kernel() is not None
    backend = get_attention_backend("auto", "cpu")
    assert isinstance(backend, CpuKernelBackend) and backend is BACKENDS["cpu"] and backend.supports_fused_decode


LONG_CASES = [
    # decode over contexts 1 .. 4,000 with partial last blocks; chunked prefill over a long cached context
    ([1, 2, 15, 17, 255, 1000, 4000], [1] * 7),
    ([4000, 1500, 33], [37, 1, 33]),
    ([3001], [3001]),
]


@pytest.mark.parametrize("seq_lens,query_lens", LONG_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 128), (4, 1, 256)])
def test_cpu_kernel_matches_reference(seq_lens, query_lens, dtype, heads, kv_heads, dim):
    """The fast path against the oracle (same dtype in and out), scattered blocks, GQA, partial blocks."""
    q, _, _, kc, vc, meta = build_case(seq_lens, query_lens, heads, kv_heads, dim, 16, dtype, seed=7)
    out = BACKENDS["cpu"].forward(q, kc, vc, meta, dim ** -0.5)
    ref = BACKENDS["reference"].forward(q, kc, vc, meta, dim ** -0.5)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens,query_lens", LONG_CASES[:2])
def test_cpu_kernel_fp32_queries_on_a_16_bit_cache(seq_lens, query_lens, kv_dtype, monkeypatch):
    """The default plans of a Q4 GGUF: fp32 activations, a bf16 KV cache (AVX512-BF16) or an fp16 one (other CPUs).
    The kernel (not the sdpa fallback) must take it and agree with the oracle reading the same entries."""
    from pagedlm.attention import cpu_kernel, torch_sdpa

    if cpu_kernel.load_kernel() is None:
        pytest.skip("CPU kernel unavailable")
    q, _, _, kc, vc, meta = build_case(seq_lens, query_lens, 9, 3, 64, 16, torch.float32, seed=11)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    monkeypatch.setattr(torch_sdpa, "paged_attention_sdpa", None)  # a fallback would now fail
    out = BACKENDS["cpu"].forward(q, kc, vc, meta, 0.125)
    assert out.dtype == torch.float32
    ref = BACKENDS["reference"].forward(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_split_keys_and_window(threads):
    """Batch-1 decode splits the key range across threads (flash-decoding); with a sliding window too."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, _, _, kc, vc, meta = build_case([2500], [1], 8, 2, 64, 16, torch.float32, seed=5)
        for window in (None, 700):
            out = BACKENDS["cpu"].forward(q, kc, vc, meta, 0.125, sliding_window=window)
            ref = BACKENDS["reference"].forward(q, kc, vc, meta, 0.125, sliding_window=window)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(prev)


def test_cpu_kernel_falls_back_for_unsupported_head_dim():
    q, ks, vs, kc, vc, meta = build_case([20], [3], 2, 1, 24, 4, torch.float32)
    out = BACKENDS["cpu"].forward(q, kc, vc, meta, 24 ** -0.5)
    torch.testing.assert_close(out.double(), dense_attention(q, ks[0], vs[0], 24 ** -0.5), atol=2e-5, rtol=1e-4)


def test_fused_rope_write_kv_equals_torch_path():
    from pagedlm.attention.cpu_kernel import load_kernel, rope_write_kv
    from pagedlm.model.layers import RotaryEmbedding

    if load_kernel() is None:
        pytest.skip("CPU kernel unavailable")
    h, kvh, d, t = 6, 2, 32, 37
    rot = RotaryEmbedding(d, 256, 10000.0)
    cos, sin = rot.cos_sin(torch.randint(0, 256, (t,)), torch.float32)
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    slots = torch.randperm(64)[:t]
    kc, vc = torch.zeros(4, 16, kvh, d), torch.zeros(4, 16, kvh, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qk = RotaryEmbedding.apply(qkv[:, :(h + kvh) * d].view(t, h + kvh, d), cos, sin)
    write_kv(qk[:, h:], qkv[:, (h + kvh) * d:].view(t, kvh, d), kc_ref, vc_ref, slots)
    fused = qkv.clone()
    assert rope_write_kv(fused, cos, sin, h, kvh, kc, vc, slots)
    torch.testing.assert_close(fused[:, :h * d].view(t, h, d), qk[:, :h], rtol=0, atol=1e-6)
    torch.testing.assert_close(kc, kc_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)
    assert not rope_write_kv(fused.bfloat16(), cos, sin, h, kvh, kc, vc, slots)  # unsupported: caller falls back


# ---- range checks of the compiled kernels --------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("length,block_size", [(200, 16), (530, 16), (530, 8)])
def test_cpu_kernel_rows_do_not_depend_on_the_batch(kv_dtype, window, length, block_size):
    """A row's result is bit for bit the same alone (a decode step) as beside its sequence's next rows (a verify
    step's draft tokens) and other sequences: key ranges split at fixed positions, tiles and the online softmax's
    chunks of tiles on fixed grids."""
    _kernel_or_skip()
    q, _, _, kc, vc, meta = build_case([length, 300, 40], [9, 1, 40], 9, 3, 64, block_size, torch.float32, seed=3)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    cpu = BACKENDS["cpu"]
    together = cpu.forward(q, kc, vc, meta, 0.125, sliding_window=window)
    table = meta.block_tables[:1]
    for j in range(9):
        pos = length - 9 + j
        alone = AttentionMetadata(meta.slot_mapping[j:j + 1], table, torch.tensor([pos + 1], dtype=torch.int32),
                                  torch.tensor([0, 1], dtype=torch.int32), [pos + 1], [1], 1, pos + 1, block_size)
        row = cpu.forward(q[j:j + 1], kc, vc, alone, 0.125, sliding_window=window)
        assert torch.equal(row, together[j:j + 1]), f"row {j} (position {pos}) differs"


@pytest.mark.parametrize("block_size", [4, 8, 32])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_blocks_smaller_and_larger_than_a_tile(block_size, kv_dtype):
    """Blocks of fewer keys than a tile (a tile per block, chunks of several blocks) and of more (several tiles per
    block): decode, prefill rows and a sliding window against the oracle."""
    from pagedlm.attention import cpu_kernel

    _kernel_or_skip()
    for seq_lens, query_lens, window in (([1, 70, 300, 1000], [1, 9, 1, 1], None), ([90, 333], [1, 20], 37)):
        q, _, _, kc, vc, meta = build_case(seq_lens, query_lens, 9, 3, 64, block_size, torch.float32, seed=5)
        kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
        assert cpu_kernel.supports(q, kc)
        out = BACKENDS["cpu"].forward(q, kc, vc, meta, 0.125, sliding_window=window)
        ref = BACKENDS["reference"].forward(q, kc, vc, meta, 0.125, sliding_window=window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def _kernel_or_skip():
    from pagedlm.attention.cpu_kernel import load_kernel

    if load_kernel() is None:
        pytest.skip("CPU kernel unavailable")


@pytest.mark.parametrize("bad", ["past_end", "negative", "narrow_table"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_cpu_kernel_rejects_block_ids_outside_the_cache(bad, kv_dtype):
    """A block id the kernel would read outside [0, num_blocks), or a table row narrower than its sequence: a
    ValueError from the kernel's check (not the sdpa fallback), the caches untouched."""
    from pagedlm.attention.cpu_kernel import paged_attention_cpu
    from pagedlm.kvcache.quant import quantize_kv

    _kernel_or_skip()
    q, _, _, kc, vc, meta = build_case([40, 9, 33], [1, 9, 2], 4, 2, 32, 16, torch.float32, seed=2)
    if kv_dtype == torch.int8:
        kc, vc = quantize_kv(kc, torch.int8), quantize_kv(vc, torch.int8)
    paged_attention_cpu(q, kc, vc, meta, 0.2)  # the untampered batch runs
    if bad == "narrow_table":
        meta.block_tables = meta.block_tables[:, :2].contiguous()  # sequence 0 (40 tokens) needs 3 blocks
    else:
        meta.block_tables[2, 1] = kc.shape[0] if bad == "past_end" else -1
    saved = kc.clone(), vc.clone()
    match = "narrower than its sequence" if bad == "narrow_table" else "block table entry .* outside the KV cache"
    with pytest.raises(ValueError, match=f"paged attention kernel .*{match}"):
        paged_attention_cpu(q, kc, vc, meta, 0.2)
    assert torch.equal(kc, saved[0]) and torch.equal(vc, saved[1])


def test_cpu_kernel_accepts_freed_blocks_outside_the_window():
    """Only the entries the kernel reads are checked: freed sliding-window blocks (NULL_BLOCK = -1, as the block
    manager leaves them) before the window are fine."""
    _kernel_or_skip()
    q, _, _, kc, vc, meta = build_case([70, 33], [1, 5], 4, 2, 32, 8, torch.float32, seed=4)
    expected = BACKENDS["reference"].forward(q, kc, vc, meta, 0.2, sliding_window=16)
    meta.block_tables[0, :6] = -1  # the window starts at 69 - 16 + 1 = 54, in block 6
    meta.block_tables[1, :1] = -1  # keys 28 - 16 + 1 = 13 .. 32: blocks 1 .. 4
    out = BACKENDS["cpu"].forward(q, kc, vc, meta, 0.2, sliding_window=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    meta.block_tables[0, 6] = -1
    with pytest.raises(ValueError, match="block table entry"):
        BACKENDS["cpu"].forward(q, kc, vc, meta, 0.2, sliding_window=16)


@pytest.mark.parametrize("bad_slot", [64, 10**9, -1])
def test_fused_rope_write_kv_rejects_slots_outside_the_cache(bad_slot):
    """The slots are checked before anything is rotated or written: the caches and qkv stay as they were."""
    from pagedlm.attention.cpu_kernel import rope_write_kv
    from pagedlm.model.layers import RotaryEmbedding

    _kernel_or_skip()
    h, kvh, d, t = 4, 2, 16, 5
    cos, sin = RotaryEmbedding(d, 64, 10000.0).cos_sin(torch.arange(t), torch.float32)
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    kc, vc = torch.randn(4, 16, kvh, d), torch.randn(4, 16, kvh, d)  # 64 slots
    saved = qkv.clone(), kc.clone(), vc.clone()
    slots = torch.tensor([3, 17, 63, bad_slot, 40])
    with pytest.raises(ValueError, match="RoPE \\+ KV write kernel .*slot mapping entry is outside the KV cache"):
        rope_write_kv(qkv, cos, sin, h, kvh, kc, vc, slots)
    assert torch.equal(qkv, saved[0]) and torch.equal(kc, saved[1]) and torch.equal(vc, saved[2])
    slots[3] = 0
    assert rope_write_kv(qkv, cos, sin, h, kvh, kc, vc, slots)
    assert not torch.equal(kc, saved[1])


# ---- every ISA path of the kernel ------------------------------------------------------------------------------

def _expected_isa(march):
    """The inner loop a -march=<march> build must compile here, or None where this CPU cannot run that build."""
    import platform

    from pagedlm.attention import cpu_kernel
    from pagedlm.cpu import cpu_features

    flags = cpu_features().flags
    avx2 = {"avx2", "fma", "f16c", "bmi2"} <= flags
    if march == cbuild.EMULATED_AVX512:
        return cpu_kernel.ISA_AVX512 if avx2 and cbuild.emulation_available() else None
    if march == "native":
        return (cpu_kernel.ISA_AVX512 if "avx512f" in flags else cpu_kernel.ISA_AVX2 if avx2
                else cpu_kernel.ISA_PORTABLE)
    if platform.machine() != "x86_64":
        return None
    avx512 = {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd"} <= flags and avx2
    return {"skylake-avx512": cpu_kernel.ISA_AVX512 if avx512 else None,
            "haswell": cpu_kernel.ISA_AVX2 if avx2 else None, "x86-64": cpu_kernel.ISA_PORTABLE}[march]


ISA_CASES = [
    # (seq_lens, query_lens, heads, kv_heads, dim, window, kv dtype)
    ([1, 16, 40, 161, 1000], [1] * 5, 9, 3, 64, None, torch.float32),  # decode, GQA, partial tiles
    ([70, 9, 300], [37, 9, 1], 9, 3, 64, None, torch.float32),  # prefill chunks and decode
    ([2500], [1], 8, 2, 128, None, torch.float32),  # long decode: split key ranges
    ([90, 33], [1, 20], 4, 1, 32, 24, torch.float32),  # sliding window
    ([161, 50], [1, 7], 9, 3, 64, None, torch.bfloat16),
    ([300, 41, 17], [60, 1, 17], 8, 2, 128, None, torch.bfloat16),  # bf16: prefill rows, odd tile ends
    ([90, 33], [1, 20], 4, 1, 32, 24, torch.bfloat16),  # bf16 with a sliding window
    ([161, 50], [1, 7], 6, 2, 80, None, torch.bfloat16),  # head_dim not a multiple of 32: converted tiles
    ([161, 50], [1, 7], 6, 2, 80, None, torch.int8),
    ([161, 50], [1, 7], 6, 2, 16, 8, torch.float8_e4m3fn),
    ([700, 40], [1, 40], 4, 1, 256, 512, torch.float32),  # Gemma 3's heads (256 wide) and sliding window
    ([700, 40], [1, 40], 4, 1, 256, None, torch.bfloat16),
    ([161, 50], [1, 7], 9, 3, 64, None, torch.float16),  # fp16: the default cache without AVX512-BF16
    ([300, 41, 17], [60, 1, 17], 8, 2, 128, 24, torch.float16),
    ([700, 40], [1, 40], 4, 1, 256, 512, torch.float16),
]


@pytest.mark.parametrize("march", ["native", "skylake-avx512", "haswell", "x86-64", cbuild.EMULATED_AVX512])
def test_cpu_kernel_isa_paths_match_reference(march):
    """The AVX-512 (with and without the AVX512-BF16 loops that read bf16 caches in place), AVX2 + FMA and portable
    inner loops, each compiled on its own (-march; the AVX-512 BF16 loops also on emulated intrinsics, so every
    CPU with AVX2 runs them), against the oracle: fp32 and bf16 queries, every cache kind, decode, prefill chunks,
    GQA, windows, split key ranges. The bf16-dot loops keep the fp32 tolerance: they split queries and
    probabilities into hi + lo bf16 parts."""
    import shutil

    from pagedlm.attention import cpu_kernel
    from pagedlm.cpu import cpu_features
    from pagedlm.kvcache.quant import quantize_kv

    expected = _expected_isa(march)
    if shutil.which("g++") is None or expected is None:
        pytest.skip(f"no g++, or this CPU cannot run a -march={march} build")
    lib = cpu_kernel.kernel_variant(march).load()
    assert lib is not None and cpu_kernel.attention_isa(lib) == expected
    # Only a native build on an AVX512-BF16 CPU has the bf16-dot loops (skylake-avx512 predates them).
    assert cpu_kernel.attention_bf16_dot(lib) == (march == cbuild.EMULATED_AVX512
                                                  or (march == "native" and "avx512_bf16" in cpu_features().flags))
    for seq_lens, query_lens, heads, kv_heads, dim, window, kv_dtype in ISA_CASES:
        for q_dtype in (torch.float32, torch.bfloat16):
            if q_dtype == torch.bfloat16 and kv_dtype == torch.float32:
                continue  # fp32 caches take fp32 queries
            q, _, _, kc, vc, meta = build_case(seq_lens, query_lens, heads, kv_heads, dim, 16, torch.float32, seed=9)
            if kv_dtype in (torch.int8, torch.float8_e4m3fn):
                kc, vc = quantize_kv(kc, kv_dtype), quantize_kv(vc, kv_dtype)
            else:
                kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
            q = q.to(q_dtype)
            assert cpu_kernel.supports(q, kc)  # the kernel, not the sdpa fallback, runs
            out = cpu_kernel.paged_attention_cpu(q, kc, vc, meta, dim ** -0.5, window, lib=lib)
            ref = BACKENDS["reference"].forward(q, kc, vc, meta, dim ** -0.5, sliding_window=window)
            tol = dict(atol=1e-5, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
            torch.testing.assert_close(out.float(), ref.float(), **tol)


def _guarded(like: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A copy of `like` whose last byte is the last one before an unreadable page (and the mapping that holds it),
    so that a kernel reading past the end of the tensor faults instead of reading garbage."""
    import ctypes
    import mmap

    nbytes = like.numel() * like.element_size()
    page = mmap.PAGESIZE
    total = -(-nbytes // page) * page + page
    buf = mmap.mmap(-1, total)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + total - page), ctypes.c_size_t(page), 0) == 0  # PROT_NONE
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=total - page - nbytes)
    t = t.view(like.dtype).view(like.shape)
    t.copy_(like)
    return t, buf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_kernel_reads_nothing_past_the_cache(dtype):
    """The kernel loads the next tile's K/V lines ahead of use (csrc/touch.h): whole aligned lines, never past the
    last row of the cache. Rows of 32 or 64 bytes (head_dim 16), one token per block, the cache ending at an
    unreadable page, and sequences that end in its last rows."""
    _kernel_or_skip()
    q, _, _, kc, vc, meta = build_case([3, 9, 5], [1, 1, 1], 2, 1, 16, 1, dtype, seed=3)
    # relabel the physical blocks so that sequence i's last token sits in block num_blocks - 1 - i
    n = kc.shape[0]
    lasts = [int(meta.block_tables[i, s - 1]) for i, s in enumerate(meta.seq_lens_list)]
    order = [b for b in range(n) if b not in lasts] + lasts[::-1]  # order[new id] = old id
    new_id = torch.empty(n, dtype=torch.long)
    new_id[torch.tensor(order)] = torch.arange(n)
    kc, vc = kc[order], vc[order]
    meta.block_tables = new_id[meta.block_tables.long()].to(torch.int32)
    assert [int(meta.block_tables[i, s - 1]) for i, s in enumerate(meta.seq_lens_list)] == [n - 1, n - 2, n - 3]
    ref = BACKENDS["reference"].forward(q, kc, vc, meta, 0.25)
    (kg, kbuf), (vg, vbuf) = _guarded(kc), _guarded(vc)
    out = BACKENDS["cpu"].forward(q, kg, vg, meta, 0.25)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    del kg, vg, kbuf, vbuf
