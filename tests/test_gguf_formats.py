"""GGUF block formats run natively: each layout the kernels read straight from the file's blocks dequantizes to
exactly gguf-py's values, its product is Q8(x) @ W^T with a row's result independent of the rows run with it, and
every ISA build this CPU runs (AVX-512 on emulated intrinsics included) gives the same bits."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from pagedlm import cbuild
from pagedlm.bench.kernel import random_gguf_blocks as random_blocks
from pagedlm.cpu import cpu_features
from pagedlm.hub.blocks import RawBlocks
from pagedlm.model import quant


def reference(raw: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols).astype(np.float32))


def _kernel_or_skip():
    lib = quant.load_quant_kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the quantized kernels are not built")
    return lib


class _Counting:
    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        return (lambda *a: self.calls.append(name) or fn(*a)) if name.startswith("pagedlm_") else fn


@pytest.mark.parametrize("kind, layout, bytes_per_32", [("Q4_0", "x16", 18), ("Q4_1", "x16", 20),
                                                        ("Q4_K", "x16_k", 18.5)])
def test_int4_blocks_run_in_their_own_layout(monkeypatch, kind, layout, bytes_per_32):
    """Q4_0 keeps no minimums (-8 x scale, the format's own: the file's 18 bytes per 32 weights) and Q4_K its
    super-block d / dmin and 6-bit scales (18.5 bytes, not 20 with fp16 scales per block): written by the kernel in
    one pass (q/k/v fused, a row permutation), dequantized exactly as gguf-py does, multiplied as Q8(x) @ W^T by the
    kernel, a row's result the same alone or in any batch."""
    lib = _kernel_or_skip()
    rows, cols = (64, 32, 48), 512
    raws = [random_blocks(kind, r, cols, seed) for seed, r in enumerate(rows)]
    perm = np.random.default_rng(9).permutation(rows[0])
    fused = RawBlocks.cat([RawBlocks.from_gguf(raws[0], kind, cols).rows(perm),
                         *(RawBlocks.from_gguf(r, kind, cols) for r in raws[1:])])
    want = torch.cat([reference(raws[0], kind, rows[0], cols)[torch.from_numpy(perm)],
                      *(reference(r, kind, n, cols) for r, n in zip(raws[1:], rows[1:]))])
    counting = _Counting(lib)
    monkeypatch.setattr(quant.kernel, "load_quant_kernel", lambda: counting)
    layer = quant.Int4Linear(fused, 32, x16=True)
    assert layer.layout == layout
    held = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scale, layer.mins))
    assert held == sum(rows) * cols // 32 * bytes_per_32
    assert torch.equal(layer.dequantize(), want)
    ids = torch.tensor([[143, 0, 17], [16, 17, 100]])
    assert torch.equal(layer.embed(ids), want[ids])  # rows looked up, as an embedding table's
    layer.kernel_max_rows = 64
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, cols, generator=g)
    full = layer(x)
    for size in (1, 2, 3, 5, 8, 9, 13):
        assert torch.equal(layer(x[4:4 + size]), full[4:4 + size]), size
    assert "pagedlm_linear_int4" in counting.calls
    ref = F.linear(layer.dense_input(x).double(), want.double())  # Q4_K: one activation scale per 256 values
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    # the same weight through the fp16 layout with minimums (-8 x scale, a minimum's FMA per block), where Q4_0's
    # own subtracts 8 x the activations' integer sum before scaling: the same product to fp32 rounding
    if kind == "Q4_0":
        with_mins = quant.Int4Linear(fused.blocks(), 32, x16=True)(x)
        assert not torch.equal(with_mins, full)
        torch.testing.assert_close(with_mins, full, rtol=1e-5, atol=1e-5)
    bf16 = torch.empty(sum(rows), cols, dtype=torch.bfloat16)
    assert layer._dequant_rows(0, sum(rows), bf16) is bf16 and torch.equal(bf16, want.to(torch.bfloat16))


def test_mixed_int4_kinds_fall_back_to_fp16_scales():
    """A fused weight mixing Q4_K with Q4_0 rows has no single native layout: its blocks take the fp16 one."""
    _kernel_or_skip()
    raw = RawBlocks.cat([RawBlocks.from_gguf(random_blocks("Q4_K", 32, 256, 0), "Q4_K", 256),
                       RawBlocks.from_gguf(random_blocks("Q4_0", 16, 256, 1), "Q4_0", 256)])
    layer = quant.Int4Linear(raw, 32, x16=True)
    assert layer.layout == "x16" and layer.mins.numel() == 48 * 8


@pytest.mark.parametrize("march", ["haswell", "x86-64", cbuild.EMULATED_AVX512])
def test_native_layouts_bit_identical_in_every_build(monkeypatch, march):
    """Each GGUF layout gives the native build's bits in the AVX2, portable and (emulated) AVX-512 builds: the
    products at 1-19 rows and the bf16 / fp32 dequantizations."""
    import platform

    _kernel_or_skip()
    if platform.machine() != "x86_64" or (march != "x86-64" and not {"avx2", "fma", "f16c"} <= cpu_features().flags):
        pytest.skip(f"this CPU cannot run a -march={march} build")
    if march == cbuild.EMULATED_AVX512 and not cbuild.emulation_available():
        pytest.skip("no SIMDe headers (libsimde-dev) for the emulated AVX-512 build")
    variant = quant.kernel_variant(march).load()
    assert variant is not None
    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, 512, generator=g)
    vnni_before = variant.pagedlm_gguf_vnni_products()
    for kind in ("Q4_0", "Q4_1", "Q4_K", *quant.GGUF_KINDS):
        raw = RawBlocks.from_gguf(random_blocks(kind, 48, 512, 4), kind, 512)
        int4 = kind.startswith("Q4")
        layer = quant.Int4Linear(raw, 32, x16=True) if int4 else quant.GGUFLinear(raw)
        layer.kernel_max_rows = 64
        native = [layer(x[:m]) for m in (1, 2, 3, 19)]
        native_bf16 = layer.dequantize_to(torch.bfloat16).clone()
        native_w = layer.dequantize()
        counting = _Counting(variant)
        monkeypatch.setattr(quant.kernel, "load_quant_kernel", lambda: counting)
        for m, want in zip((1, 2, 3, 19), native):
            assert torch.equal(layer(x[:m]), want), (kind, m)
        assert torch.equal(layer.dequantize_to(torch.bfloat16), native_bf16), kind
        assert torch.equal(layer.dequantize(), native_w), kind
        monkeypatch.undo()
        assert counting.calls.count("pagedlm_linear_int4" if int4 else "pagedlm_linear_gguf") == 4
    # the 5- to 8-bit kinds' products (Q8_0's single row aside: a kernel of its own) ran the AVX-512 VNNI kernel in
    # that build only
    vnni = sum(3 if kind == "Q8_0" else 4 for kind in quant.GGUF_KINDS) if march == cbuild.EMULATED_AVX512 else 0
    assert variant.pagedlm_gguf_vnni_products() - vnni_before == vnni


@pytest.mark.parametrize("march", ["native", "haswell", "x86-64", cbuild.EMULATED_AVX512])
def test_a_pass_of_one_row_after_full_passes_reads_its_own_row(monkeypatch, march):
    """The x16 products run 256 rows of x per pass over the weights; a last pass of a single row (257, 513 rows: a
    257-token prompt) takes the one-row kernels, which read that row's activations and write its outputs, not row
    0's: each row of a 257-row product equals its product alone, in every layout and build."""
    import platform

    _kernel_or_skip()
    if march != "native" and (platform.machine() != "x86_64"
                              or (march != "x86-64" and not {"avx2", "fma", "f16c"} <= cpu_features().flags)):
        pytest.skip(f"this CPU cannot run a -march={march} build")
    if march == cbuild.EMULATED_AVX512 and not cbuild.emulation_available():
        pytest.skip("no SIMDe headers (libsimde-dev) for the emulated AVX-512 build")
    variant = quant.kernel_variant(march).load() if march != "native" else quant.load_quant_kernel()
    assert variant is not None
    g = torch.Generator().manual_seed(3)
    x = torch.randn(257, 256, generator=g)
    layers = {kind: (quant.Int4Linear(raw, 32, x16=True) if kind.startswith("Q4") else quant.GGUFLinear(raw))
              for kind in ("Q4_0", "Q4_1", "Q4_K", *quant.GGUF_KINDS)
              for raw in [RawBlocks.from_gguf(random_blocks(kind, 64, 256, 5), kind, 256)]}
    layers["int8 x16"] = quant.Int8Linear(torch.randn(64, 256, generator=g), x16=True)
    monkeypatch.setattr(quant.kernel, "load_quant_kernel", lambda: variant)  # the layouts built, this build runs them
    for name, layer in layers.items():
        assert getattr(layer, "x16", True), name
        y = layer(x)
        for m in (0, 255, 256):
            assert torch.equal(y[m], layer(x[m:m + 1])[0]), (name, m)


@pytest.mark.parametrize("march", ["native", "haswell", cbuild.EMULATED_AVX512])
def test_one_row_reads_tiles_in_pairs_or_alone_with_the_same_bits(monkeypatch, march):
    """Decode (one row) reads x16 tiles in pairs (two memory streams per core) or one at a time, by CPU
    (pagedlm_row_pairs): the same bits either way, in every layout, and the pairs ran where the build has them
    (AVX-512 VNNI: int4, int8 and Q8_0; AVX2: the GGUF kinds)."""
    import platform

    _kernel_or_skip()
    if march != "native" and (platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= cpu_features().flags):
        pytest.skip(f"this CPU cannot run a -march={march} build")
    if march == cbuild.EMULATED_AVX512 and not cbuild.emulation_available():
        pytest.skip("no SIMDe headers (libsimde-dev) for the emulated AVX-512 build")
    variant = quant.kernel_variant(march).load() if march != "native" else quant.load_quant_kernel()
    g = torch.Generator().manual_seed(4)
    layers = {kind: (quant.Int4Linear(raw, 32, x16=True) if kind.startswith("Q4") else quant.GGUFLinear(raw))
              for kind in ("Q4_0", "Q4_K", *quant.GGUF_KINDS)
              for raw in [RawBlocks.from_gguf(random_blocks(kind, 96, 512, 6), kind, 512)]}
    layers["int8 x16"] = quant.Int8Linear(torch.randn(96, 512, generator=g), x16=True)
    x = torch.randn(1, 512, generator=g)
    native_vnni = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"} <= cpu_features().flags
    vnni = march == cbuild.EMULATED_AVX512 or (march == "native" and native_vnni)
    avx2 = march == "haswell" or (march == "native" and not native_vnni and {"avx2", "fma"} <= cpu_features().flags)
    monkeypatch.setattr(quant.kernel, "load_quant_kernel", lambda: variant)
    before = variant.pagedlm_row_pairs(1)
    try:
        for name, layer in layers.items():
            variant.pagedlm_row_pairs(1)
            passes, q8_rows = variant.pagedlm_row_pair_passes(), variant.pagedlm_q8_0_row_passes()
            paired = layer(x)
            ran = variant.pagedlm_row_pair_passes() - passes
            variant.pagedlm_row_pairs(0)
            passes = variant.pagedlm_row_pair_passes()
            assert torch.equal(layer(x), paired), name
            assert variant.pagedlm_row_pair_passes() == passes, name
            gguf_kind = name in quant.GGUF_KINDS
            # Q8_0's one-row VNNI kernel read the row both times: its tiles in pairs, then one at a time
            assert variant.pagedlm_q8_0_row_passes() - q8_rows == (2 if vnni and name == "Q8_0" else 0), name
            if vnni:
                assert ran == (1 if not gguf_kind or name == "Q8_0" else 0), name
            elif avx2:
                assert ran == (1 if gguf_kind else 0), name
    finally:
        variant.pagedlm_row_pairs(before)


@pytest.mark.parametrize("kind, bytes_per_32", [("Q8_0", 34), ("Q5_0", 22), ("Q5_K", 22.5), ("Q6_K", 26.25),
                                                 ("Q3_K", 14.25), ("Q2_K", 12.5), ("IQ4_NL", 18), ("IQ4_XS", 17.25)])
def test_gguf_blocks_run_in_their_own_layout(monkeypatch, kind, bytes_per_32):
    """Q8_0 / Q5_0 / Q5_K / Q6_K / Q3_K / Q2_K / IQ4_NL / IQ4_XS weights keep the file's codes and scales (about
    their bytes; no second rounding to int8): written in one pass (a fused weight, a row permutation), dequantized
    exactly as gguf-py does, multiplied as Q8(x) @ W^T by their kernel, a row's result the same alone or in any
    batch."""
    lib = _kernel_or_skip()
    rows, cols = (32, 16, 48), 512
    raws = [random_blocks(kind, r, cols, seed) for seed, r in enumerate(rows)]
    perm = np.random.default_rng(7).permutation(rows[0])
    fused = RawBlocks.cat([RawBlocks.from_gguf(raws[0], kind, cols).rows(perm),
                           *(RawBlocks.from_gguf(r, kind, cols) for r in raws[1:])])
    want = torch.cat([reference(raws[0], kind, rows[0], cols)[torch.from_numpy(perm)],
                      *(reference(r, kind, n, cols) for r, n in zip(raws[1:], rows[1:]))])
    counting = _Counting(lib)
    monkeypatch.setattr(quant.kernel, "load_quant_kernel", lambda: counting)
    layer = quant.GGUFLinear(fused)
    held = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.planes, layer.scale, layer.aux))
    assert held == sum(rows) * cols // 32 * bytes_per_32
    assert torch.equal(layer.dequantize(), want)
    assert torch.equal(layer.dequantize_to(torch.bfloat16), want.to(torch.bfloat16))
    layer.kernel_max_rows = 64
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(3))
    vnni_before = lib.pagedlm_gguf_vnni_products()
    full = layer(x)
    if {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"} <= cpu_features().flags:
        assert lib.pagedlm_gguf_vnni_products() == vnni_before + 1  # AVX-512 VNNI: the AVX2 build's bits (below)
    for size in (1, 2, 3, 5, 8, 9, 13):
        assert torch.equal(layer(x[4:4 + size]), full[4:4 + size]), size
    assert counting.calls.count("pagedlm_linear_gguf") == 8
    ref = F.linear(layer.dense_input(x).double(), want.double())  # K-quants: one activation scale per 256 values
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)


def test_gguf_layer_needs_one_kind_and_whole_tiles():
    _kernel_or_skip()
    mixed = RawBlocks.cat([RawBlocks.from_gguf(random_blocks("Q5_0", 16, 256, 0), "Q5_0", 256),
                           RawBlocks.from_gguf(random_blocks("Q8_0", 16, 256, 1), "Q8_0", 256)])
    assert not quant.GGUFLinear.supports(mixed)  # Gemma 3's q/k Q5_0 beside v Q8_0: no single layout
    assert not quant.GGUFLinear.supports(RawBlocks.from_gguf(random_blocks("Q6_K", 40, 256, 2), "Q6_K", 256))
    assert quant.GGUFLinear.supports(RawBlocks.from_gguf(random_blocks("Q6_K", 48, 256, 2), "Q6_K", 256))
    with pytest.raises(ValueError, match="no x16 layout"):
        quant.GGUFLinear(mixed)


def test_a_fused_weight_mixing_kinds_runs_part_by_part():
    """Q4_K_M's q/k/v: Q4_K q and k beside a Q6_K v. Each run of one kind keeps its own layer (q and k together),
    so the weight is exactly the file's, and its product is the parts' side by side."""
    _kernel_or_skip()
    kinds, rows, cols = ("Q4_K", "Q4_K", "Q6_K"), (64, 16, 16), 512
    raws = [random_blocks(k, r, cols, seed) for seed, (k, r) in enumerate(zip(kinds, rows))]
    fused = RawBlocks.cat([RawBlocks.from_gguf(r, k, cols) for r, k in zip(raws, kinds)])
    layer = quant.ConcatLinear.from_blocks(fused)
    assert [type(p) for p in layer.parts] == [quant.Int4Linear, quant.GGUFLinear]
    assert [p.out_features for p in layer.parts] == [80, 16] and layer.out_features == 96
    want = torch.cat([reference(r, k, n, cols) for r, k, n in zip(raws, kinds, rows)])
    assert torch.equal(layer.dequantize(), want)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(4))
    ref = torch.cat([F.linear(p.dense_input(x).double(), p.dequantize().double()) for p in layer.parts], -1)
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    bad = RawBlocks.cat([RawBlocks.from_gguf(raws[0], "Q4_K", cols),
                         RawBlocks.from_gguf(random_blocks("Q6_K", 8, cols, 9), "Q6_K", cols)])
    assert quant.ConcatLinear.from_blocks(bad) is None  # 8 rows of Q6_K: no whole tile, no native layer


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS"])
def test_k_quants_take_activations_per_256_values_and_rows_stay_independent(kind):
    """The K-quants' products quantize the activations with one scale per 256 values (llama.cpp's Q8_K) and reduce
    each super-block in integers: within fp32 rounding of that reference, far from the per-32 one (the per-256 path
    ran), and every row's bits are its own, alone or with 1-18 other rows (row groups of 8 and their remainders)."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(8)
    raw = RawBlocks.from_gguf(random_blocks(kind, 32, 512, 8), kind, 512)
    layer = quant.Int4Linear(raw, 32, x16=True) if kind == "Q4_K" else quant.GGUFLinear(raw)
    assert getattr(layer, "layout", "x16_k") == "x16_k"
    layer.kernel_max_rows = 64
    x = torch.randn(19, 512, generator=g)
    x[:, 256:] *= 20  # the two super-blocks' scales differ: per 256 values is not per row
    full = layer(x)
    for size in range(1, 19):
        for start in range(0, 19 - size + 1, 6):
            assert torch.equal(layer(x[start:start + size]), full[start:start + size]), (size, start)
    w = layer.dequantize().double()
    x256 = quant.quantize_activations_q8(x, 256).double()
    per_256, per_32 = F.linear(x256, w), F.linear(quant.quantize_activations_q8(x, 32).double(), w)
    err = (full.double() - per_256).abs()
    assert (err <= 1e-6 * F.linear(x256.abs(), w.abs())).all()  # fp32 rounding of the terms' magnitudes
    assert (per_32 - per_256).abs().max() > 100 * err.max()


def quantize_q3_k(a: np.ndarray) -> np.ndarray:
    """GGUF Q3_K blocks of `a` [rows, cols] (cols a multiple of 256; gguf-py quantizes no K-quant): per 16 values a
    6-bit scale of the super-block's fp16 d, codes -4..3 (2 low bits, the 3rd in hmask, set meaning no -4)."""
    rows, cols = a.shape
    x = a.reshape(rows, cols // 256, 16, 16).astype(np.float32)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    group = -peak / 4  # the value of largest magnitude at code -4, as llama.cpp's quantizer places it
    d = (np.abs(group).max(-1) / 31).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(group, df, out=np.zeros_like(group), where=df > 0)), -32, 31)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), -4, 3).astype(np.int32) + 4
    q = q.reshape(rows, -1, 8, 32)  # [.., block k of 32, value l]
    hmask = ((q >> 2) << np.arange(8).reshape(1, 1, 8, 1)).sum(2).astype(np.uint8)  # bit k of byte l
    low = (q & 3).reshape(rows, -1, 2, 4, 32)  # value 128n + 32j + l: byte 32n + l, bits 2j
    qs = (low << (2 * np.arange(4)).reshape(1, 1, 1, 4, 1)).sum(3).astype(np.uint8).reshape(rows, -1, 64)
    s6 = (sc + 32).astype(np.uint8)  # [.., 16]
    scales = np.zeros((rows, cols // 256, 12), np.uint8)
    scales[..., :8] = (s6[..., :8] & 0x0F) | ((s6[..., 8:] & 0x0F) << 4)
    for i in range(16):
        scales[..., 8 + i % 4] |= (s6[..., i] >> 4) << (2 * (i // 4))
    out = np.concatenate([hmask, qs, scales, d[..., None].view(np.uint8)], -1)
    return out.reshape(rows, -1)


IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


def quantize_iq4_xs(a: np.ndarray) -> np.ndarray:
    """GGUF IQ4_XS blocks of `a` [rows, cols] (cols a multiple of 256): per 32 values a 6-bit scale of the
    super-block's fp16 d, each value the nearest of IQ4's 16 levels."""
    rows, cols = a.shape
    x = a.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    block = peak / IQ4_VALUES[0]  # the value of largest magnitude at level 0 (-127)
    d = (np.abs(block).max(-1) / 31).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(block, df, out=np.zeros_like(block), where=df > 0)), -32, 31)
    step = (df * sc)[..., None]
    q = np.abs(np.divide(x, step, out=np.zeros_like(x), where=step != 0)[..., None] - IQ4_VALUES).argmin(-1)
    ls = (sc + 32).astype(np.uint16)  # [.., 8]
    high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
    low = (ls & 15).astype(np.uint8).reshape(rows, -1, 4, 2)
    qs = (q[..., :16] | q[..., 16:] << 4).astype(np.uint8).reshape(rows, -1, 128)
    out = np.concatenate([d[..., None].view(np.uint8), high[..., None].view(np.uint8),
                          (low[..., 0] | low[..., 1] << 4), qs], -1)
    return out.reshape(rows, -1)


def quantize_q2_k(a: np.ndarray) -> np.ndarray:
    """GGUF Q2_K blocks of `a` [rows, cols] (cols a multiple of 256): per 16 values a 4-bit scale of the super-block's
    fp16 d and a 4-bit minimum of its dmin, codes 0..3 (Q3_K's order of the 2-bit codes)."""
    rows, cols = a.shape
    x = a.reshape(rows, cols // 256, 16, 16).astype(np.float32)
    low = np.minimum(x.min(-1), 0)
    step, floor = (x.max(-1) - low) / 3, -low
    d = (step.max(-1) / 15).astype(np.float16)
    dmin = (floor.max(-1) / 15).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 15)
    m = np.clip(np.round(np.divide(floor, dminf, out=np.zeros_like(floor), where=dminf > 0)), 0, 15)
    unit = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x + (dminf * m)[..., None], unit, out=np.zeros_like(x), where=unit > 0)), 0, 3)
    low2 = q.astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # value 128n + 32j + l: byte 32n + l, bits 2j
    qs = (low2 << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)).sum(3).astype(np.uint8)
    scales = (sc.astype(np.uint8) | m.astype(np.uint8) << 4)
    out = np.concatenate([scales, qs.reshape(rows, -1, 64), d[..., None].view(np.uint8),
                          dmin[..., None].view(np.uint8)], -1)
    return out.reshape(rows, -1)


QUANTIZERS = {"Q3_K": quantize_q3_k, "IQ4_XS": quantize_iq4_xs, "Q2_K": quantize_q2_k}  # gguf-py quantizes none


@pytest.mark.parametrize("kind, group, step, corr", [("Q3_K", 16, 1 / 4, 0.97), ("IQ4_XS", 32, 16 / 127, 0.99),
                                                    ("Q2_K", 16, 1 / 3, 0.93)])
def test_reference_quantizers_round_trip(kind, group, step, corr):
    """The tests' quantizers write valid blocks: gguf-py dequantizes them to within a level's step of the input
    (a step relative to the largest value of its group of `group`, where the levels are widest apart)."""
    a = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    w = reference(QUANTIZERS[kind](a), kind, 16, 512).numpy()
    bound = np.abs(a.reshape(16, -1, group)).max(-1, keepdims=True) * step
    assert (np.abs(w - a).reshape(16, -1, group) <= 1.1 * bound).all()
    assert np.corrcoef(w.ravel(), a.ravel())[0, 1] > corr


def _tiny_llama_gguf(tmp_path, quant_kind: str, vocab_quant: str | None = None, tied: bool = False):
    """A 2-layer LLaMA written as a GGUF of `quant_kind` layers (`vocab_quant`: its embedding table and an untied
    LM head too), loaded as quantized blocks and, as the reference, dequantized to fp32."""
    from conftest import build_tiny_tokenizer
    from test_families import write_gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedlm import LLM

    _kernel_or_skip()
    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=None, bos_token_id=None,
                      hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model_dir = tmp_path / "hf"
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    path = write_gguf(model_dir, tmp_path / f"{quant_kind}.gguf", "llama", quant=quant_kind, vocab_quant=vocab_quant)
    llm = LLM(str(path), num_kv_blocks=64, speculative_config="off")
    ref = LLM(str(path), dtype="float32", num_kv_blocks=64, speculative_config="off")  # dequantized, fp32 products
    return path, llm, ref


def _assert_logprobs_close(llm, ref, bound: float = 0.03) -> None:
    """The prompts' and each decoded token's log-probabilities under `llm` are the reference's within `bound` (the
    Q8 rounding of the activations), each token scored by the reference after the same tokens."""
    from pagedlm import SamplingParams

    prompts = [[5, 9, 30, 41, 17], list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    whole = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]  # our decoded tokens, scored by ref
    refs = ref.generate(whole, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for ours, theirs, seq, prompt in zip(outs, refs, whole, prompts):
        ours_lp = [ours.prompt_logprobs[pos][seq[pos]].logprob for pos in range(1, len(prompt))]
        ours_lp += [step[tid].logprob for step, tid in zip(ours.outputs[0].logprobs, ours.outputs[0].token_ids)]
        theirs_lp = [theirs.prompt_logprobs[pos][seq[pos]].logprob for pos in range(1, len(seq))]
        assert len(ours_lp) == len(theirs_lp) == len(seq) - 1
        assert max(abs(a - b) for a, b in zip(ours_lp, theirs_lp)) < bound


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_a_model_of_2_3_or_iq4_blocks_runs_them_as_stored(tmp_path, kind):
    """A LLaMA whose layers' matrices are Q3_K (Q3_K_M's main kind), Q2_K or IQ4_XS runs them as stored, in their own
    kernel and in the fused decode stack (they were requantized to int8: about twice the file's bytes), with the
    dequantized fp32 model's log-probabilities (to the Q8 rounding of the activations), the prompts' and each decoded
    token's, and the memory plan counts them at their layout's bytes."""
    from pagedlm.model.llama_decode import load_decode_kernel
    from pagedlm.model.plan import estimate_weight_bytes

    path, llm, ref = _tiny_llama_gguf(tmp_path, kind)
    runner = llm.engine.runner
    assert f"{kind} blocks run as stored" in llm.engine.plan.describe()
    layers = [m for m in runner.model.modules() if isinstance(m, quant.GGUFLinear)]
    assert len(layers) == 2 * 4 and all(m.kind == kind for m in layers)  # q/k/v, o, gate/up, down
    assert estimate_weight_bytes(path, llm.engine.plan) == pytest.approx(runner.weight_bytes(), rel=0.02)
    assert (runner.model.decode_kernel() is not None) == (load_decode_kernel() is not None)
    _assert_logprobs_close(llm, ref)


@pytest.mark.parametrize("kind, bytes_per_32, tied", [("Q4_0", 18, False), ("Q4_1", 20, False), ("Q4_0", 18, True)])
def test_a_table_and_lm_head_of_int4_blocks_run_them_as_stored(tmp_path, kind, bytes_per_32, tied):
    """An embedding table and LM head stored in Q4_0 / Q4_1 (files quantized whole, e.g. by gguf-py; a Llama 3.1 8B
    Q4_K_M's untied table) keep their blocks: the head runs them in the int4 kernel, the table's rows are looked up
    from them; tied, one layer is both. Both were requantized: to int8 (1.8x the bytes; for the head, what every
    decoded token reads), or an untied head to int4 from the dequantized values (a second rounding) where the file
    held no other kinds. Log-probabilities are the dequantized fp32 model's, and the memory plan counts both at
    their blocks' bytes."""
    from pagedlm.model.plan import estimate_weight_bytes

    path, llm, ref = _tiny_llama_gguf(tmp_path, kind, vocab_quant=kind, tied=tied)
    model = llm.engine.runner.model
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    head, table = model.lm_head, model.embed_tokens.table
    assert (head is table) == tied and ("output.weight" in stored) != tied
    for layer, name in ((head, "output.weight"), (table, "token_embd.weight")):
        assert isinstance(layer, quant.Int4Linear) and layer.x16
        n, k = layer.out_features, layer.in_features
        want = reference(stored[name if name in stored else "token_embd.weight"].data, kind, n, k)
        assert torch.equal(layer.dequantize(), want)
        held = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scale, layer.mins))
        assert held == n * k // 32 * bytes_per_32
    ids = torch.tensor([[0, 17, 16, 511], [300, 17, 17, 2]])
    assert torch.equal(model.embed_tokens(ids), want[ids])
    with pytest.raises(RuntimeError, match="ids outside"):
        table.embed(torch.tensor([512]))
    assert estimate_weight_bytes(path, llm.engine.plan) == pytest.approx(llm.engine.runner.weight_bytes(), rel=0.02)
    _assert_logprobs_close(llm, ref)
