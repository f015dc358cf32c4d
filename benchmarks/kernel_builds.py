"""Time two or more builds of a kernel source against each other, alternately in one process (medians; the order
reversed every other repetition): an older
source (e.g. from `git worktree add /tmp/old <commit>`) against the working tree's. The builds must agree.

    .venv/bin/python benchmarks/kernel_builds.py attention /tmp/old/src/pagedlm/attention/csrc/paged_attention.cpp \
        src/pagedlm/attention/csrc/paged_attention.cpp --batch 64 --context 192
    .venv/bin/python benchmarks/kernel_builds.py int4 /tmp/old/src/pagedlm/model/csrc/quant_linear.cpp \
        src/pagedlm/model/csrc/quant_linear.cpp

`attention`: decode over `--layers` separate bf16 caches in turn (30, as SmolLM2 has: their K/V do not fit the
caches, so each call reads them cold, as in a real step; `--march haswell`: the AVX2 builds). `int4`: the x16 int4
product at 1 to 2,048 rows for SmolLM2's projection shapes. `gguf`: each GGUF block kind (`--kinds`) at 1 row of
cold weights and 8 to 256 rows (`--march haswell`: the AVX2 builds).
Each source must sit in its own checkout (its #includes are relative). `--rounding-changed`: the builds may differ
(a change that rounds otherwise, e.g. Q4_K's activations per 256 values): the largest relative difference is
printed instead of asserting equal bits.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import torch

from pagedlm import cbuild


def _load(sources: list[str], configure, march: str = "native") -> dict[str, ctypes.CDLL]:
    libs = {}
    for i, src in enumerate(sources):
        lib = cbuild.KernelLibrary(Path(src), f"build {i} ({src})", "nothing", configure, march=march).load()
        if lib is None:
            raise SystemExit(f"could not build {src}")
        libs[f"#{i}"] = lib
    return libs


def _in_turn(libs: dict[str, ctypes.CDLL], rep: int) -> list[tuple[str, ctypes.CDLL]]:
    """The builds in turn, their order reversed every other repetition: on these hosts the position in the turn
    alone moved a build's median by up to a quarter."""
    order = list(libs.items())
    return order if rep % 2 == 0 else order[::-1]


def _line(label: str, times: dict[str, list[float]]) -> str:
    med = {n: statistics.median(t) for n, t in times.items()}
    base = next(iter(med.values()))
    return f"{label}: " + "  ".join(f"{n} {v * 1e6:9.1f} us ({base / v:.2f}x)" for n, v in med.items())


def attention(sources: list[str], batch: int, context: int, layers: int, reps: int, heads: str,
              march: str = "native") -> None:
    from pagedlm.attention import cpu_kernel
    from pagedlm.bench.kernel import decode_case

    def configure(lib: ctypes.CDLL) -> None:  # the entry point every version has
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.pagedlm_paged_attention.argtypes = [i, i, p, p, p, p, p, i, p, p, i, i, i, i, i, i, i, ctypes.c_float, i,
                                                i]
        lib.pagedlm_paged_attention.restype = i

    libs = _load(sources, configure, march)
    h, kvh = (int(x) for x in heads.split(","))
    cases = []
    for seed in range(layers):
        q, kc, vc, meta, _, _ = decode_case(batch, context, h, kvh, seed=seed)
        cases.append((q, kc.bfloat16(), vc.bfloat16(), meta))
    outs = {n: [cpu_kernel.paged_attention_cpu(q, k, v, m, 0.125, lib=lib) for q, k, v, m in cases]
            for n, lib in libs.items()}
    first = next(iter(outs.values()))
    for out in outs.values():
        for a, b in zip(out, first):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    times: dict[str, list[float]] = {n: [] for n in libs}
    for r in range(reps):
        for n, lib in _in_turn(libs, r):
            t = time.perf_counter()
            for q, k, v, m in cases:
                cpu_kernel.paged_attention_cpu(q, k, v, m, 0.125, lib=lib)
            times[n].append(time.perf_counter() - t)
    print(_line(f"attention ({march}), bf16 KV, {h} / {kvh} heads, batch {batch} x context {context}, {layers} layers",
                times))


EXACT = True  # --rounding-changed clears it


def _time_layer(libs: dict[str, ctypes.CDLL], layer, x: torch.Tensor, reps: int) -> dict[str, list[float]]:
    """Seconds per call of `layer`'s kernel in each build, the builds alternated; they must give the same bits
    (unless --rounding-changed)."""
    ys = {name: torch.empty(x.shape[0], layer.out_features) for name in libs}
    for name, lib in libs.items():
        layer._kernel(lib, x, ys[name])
    first = next(iter(ys.values()))
    if EXACT:
        assert all(torch.equal(y, first) for y in ys.values()), "builds disagree"
    else:
        rel = max(((y - first).abs().max() / first.abs().max()).item() for y in ys.values())
        print(f"  (largest difference between the builds: {rel:.1e} of the largest output)")
    times: dict[str, list[float]] = {name: [] for name in libs}
    for r in range(reps):
        for name, lib in _in_turn(libs, r):
            t = time.perf_counter()
            layer._kernel(lib, x, ys[name])
            times[name].append(time.perf_counter() - t)
    return times


def _configure_products(lib: ctypes.CDLL) -> None:
    """The products' entry points alone (older sources lack some of the others)."""
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.pagedlm_linear_int4.argtypes = [p, p, p, p, p, i, i, i, i, i, i]
    lib.pagedlm_linear_gguf.argtypes = [p, i, p, p, p, p, p, i, i, i, i]
    for fn in (lib.pagedlm_linear_int4, lib.pagedlm_linear_gguf):
        fn.restype = i


def int4(sources: list[str], reps: int) -> None:
    from pagedlm.model import quant

    libs = _load(sources, _configure_products)
    g = torch.Generator().manual_seed(0)
    for rows in (1, 16, 64, 2048):
        for k, n in ((576, 3072), (1536, 576), (576, 960)):
            layer = quant.Int4Linear(torch.randn(n, k, generator=g) * 0.05, 32)
            x = torch.randn(rows, k, generator=g)
            times = _time_layer(libs, layer, x, max(5, min(reps * 10, int(2e4 / rows))))
            print(_line(f"int4 x16{' (x16 layout off: row layout)' if not layer.x16 else ''}, "
                        f"{rows:4d} rows, {k} -> {n}", times))


def gguf(sources: list[str], reps: int, kinds: list[str], march: str = "native") -> None:
    """GGUF block kinds as the file stores them: several rows on a 2,048 -> 5,632 projection (in cache), one row on
    8,192 -> 32,768 (cold: larger than the last-level cache, as decode reads a model's weights)."""
    from pagedlm.bench.kernel import random_gguf_blocks
    from pagedlm.hub.blocks import RawBlocks
    from pagedlm.model import quant

    libs = _load(sources, _configure_products, march)
    g = torch.Generator().manual_seed(0)
    for kind in kinds:
        for rows, (k, n) in ((1, (8192, 32768)), (8, (2048, 5632)), (64, (2048, 5632)), (256, (2048, 5632))):
            raw = RawBlocks.from_gguf(random_gguf_blocks(kind, n, k, 1), kind, k)
            layer = quant.Int4Linear(raw, 32, x16=True) if kind.startswith("Q4") else quant.GGUFLinear(raw)
            times = _time_layer(libs, layer, torch.randn(rows, k, generator=g), reps)
            gmacs = rows * k * n / statistics.median(times[next(reversed(times))]) / 1e9
            print(_line(f"{kind}, {rows:3d} rows, {k} -> {n} (last build {gmacs:.0f} GMAC/s)", times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", choices=["attention", "int4", "gguf"])
    ap.add_argument("sources", nargs="+", help="kernel sources, the first is the baseline")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9,3", help="attention: query and kv heads (the 1B: 32,4)")
    ap.add_argument("--march", default="native", help="attention, gguf: the build target (haswell: the AVX2 path)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", default="Q8_0,Q5_0,Q5_K,Q6_K,Q4_K,Q4_0", help="gguf: the block kinds")
    ap.add_argument("--rounding-changed", action="store_true", help="the builds may give different bits")
    args = ap.parse_args()
    global EXACT
    EXACT = not args.rounding_changed
    torch.set_num_threads(args.threads)
    if args.kernel == "attention":
        attention(args.sources, args.batch, args.context, args.layers, args.repeats, args.heads, args.march)
    elif args.kernel == "gguf":
        gguf(args.sources, args.repeats, args.kinds.split(","), args.march)
    else:
        int4(args.sources, args.repeats)


if __name__ == "__main__":
    main()
