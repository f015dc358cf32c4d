"""`pagedlm bench throughput` (offline batch) and `pagedlm bench latency` (single stream, and prefill rates).

Every backend gets the same prompts (random token ids of equal length) and generates exactly the same number of
tokens greedily (EOS ignored). Each repetition draws new prompts, so no backend is timed on a prompt it has seen
(pagedlm's prefix cache would otherwise skip the prefill from the second repetition on). Backends run alternately,
repetition by repetition, so that a noisy machine slows them alike; the tables report medians and the ratio to the
first backend.
"""
from __future__ import annotations

import logging
import platform
import time
import zlib
from dataclasses import asdict, dataclass

import torch

from pagedlm.bench.backends import Backend, make_backend, threads_note
from pagedlm.bench.common import format_table, make_prompts, median, write_json

logger = logging.getLogger(__name__)


@dataclass
class ThroughputRow:
    backend: str
    batch: int
    output_tok_s: float  # median over repeats
    min_tok_s: float
    max_tok_s: float
    ratio: float | None = None  # to the first backend at the same batch size


@dataclass
class LatencyRow:
    backend: str
    tok_s: float  # output_len / end-to-end time, median
    e2e_s: float
    ttft_ms: float  # time to generate 1 token (prefill + first decode)
    tpot_ms: float  # (e2e - ttft) / (output_len - 1)
    ratio: float | None = None


def load_backends(names: list[str], model: str, dtype: str, engine_kwargs: dict) -> list[Backend]:
    out = []
    for name in names:
        try:
            out.append(make_backend(name, model, dtype, engine_kwargs))
        except ImportError as e:
            logger.warning("Skipping backend %s: %s (install its optional package).", name, e)
    if not out:
        raise ValueError("no backend could be loaded")
    return out


def _timed(backend: Backend, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = backend.generate(prompts, max_tokens)
    return time.perf_counter() - t0, n


def _fresh_prompts(vocab_size: int, num: int, input_len: int, seed: int, repeat: int,
                   kind: str) -> list[list[int]]:
    """The prompts of one repetition of one benchmark `kind`: the same for every backend, new for every
    repetition and benchmark."""
    return make_prompts(vocab_size, num, input_len, zlib.crc32(repr((seed, repeat, kind, input_len)).encode()))


def run_throughput(backends: list[Backend], vocab_size: int, batch_sizes: list[int], input_len: int,
                   output_len: int, repeats: int, seed: int = 0) -> list[ThroughputRow]:
    warm = make_prompts(vocab_size, 2, input_len, seed)
    for b in backends:  # warm-up: first-call costs (kernel build, allocator, caches) are not measured
        b.generate(warm, 4)
    rows = []
    for bs in batch_sizes:
        rates: dict[str, list[float]] = {b.name: [] for b in backends}
        for r in range(repeats):
            prompts = _fresh_prompts(vocab_size, bs, input_len, seed, r, "throughput")
            for b in backends:
                dt, n = _timed(b, prompts, output_len)
                rates[b.name].append(n / dt)
                logger.info("%s batch %d: %.1f tok/s", b.name, bs, n / dt)
        first = median(rates[backends[0].name])
        for b in backends:
            m = median(rates[b.name])
            rows.append(ThroughputRow(b.name, bs, m, min(rates[b.name]), max(rates[b.name]), m / first))
    return rows


def run_latency(backends: list[Backend], vocab_size: int, input_len: int, output_len: int, repeats: int,
                seed: int = 0) -> list[LatencyRow]:
    for b in backends:
        b.generate(make_prompts(vocab_size, 1, input_len, seed), 4)
    e2e: dict[str, list[float]] = {b.name: [] for b in backends}
    ttft: dict[str, list[float]] = {b.name: [] for b in backends}
    for r in range(repeats):
        first, whole = _fresh_prompts(vocab_size, 2, input_len, seed, r, "latency")
        for b in backends:
            ttft[b.name].append(_timed(b, [first], 1)[0])
            e2e[b.name].append(_timed(b, [whole], output_len)[0])
    rows = []
    for b in backends:
        t, f = median(e2e[b.name]), median(ttft[b.name])
        rows.append(LatencyRow(b.name, output_len / t, t, f * 1e3, (t - f) / max(1, output_len - 1) * 1e3))
    for r in rows:
        r.ratio = r.tok_s / rows[0].tok_s
    return rows


@dataclass
class PrefillRow:
    backend: str
    prompt_len: int
    tok_s: float  # prompt tokens / time to the first token, median
    ttft_s: float
    ratio: float | None = None


def run_prefill(backends: list[Backend], vocab_size: int, lengths: list[int], repeats: int,
                seed: int = 0) -> list[PrefillRow]:
    """Time to the first token of one new prompt per length and repetition (nothing cached)."""
    rows = []
    for n in lengths:
        times: dict[str, list[float]] = {b.name: [] for b in backends}
        for r in range(repeats):
            prompt = _fresh_prompts(vocab_size, 1, n, seed, r, "prefill")
            for b in backends:
                times[b.name].append(_timed(b, prompt, 1)[0])
        first = None
        for b in backends:
            t = median(times[b.name])
            row = PrefillRow(b.name, n, n / t, t)
            first = first or row.tok_s
            row.ratio = row.tok_s / first
            rows.append(row)
    return rows


PREFILL_COLUMNS = [("backend", "backend", ""), ("prompt_len", "prompt tokens", "d"), ("tok_s", "prefill tok/s", ".1f"),
                   ("ttft_s", "TTFT s", ".3f"), ("ratio", "ratio", ".2f")]
THROUGHPUT_COLUMNS = [("backend", "backend", ""), ("batch", "batch", "d"), ("output_tok_s", "output tok/s", ".1f"),
                      ("min_tok_s", "min", ".1f"), ("max_tok_s", "max", ".1f"), ("ratio", "ratio", ".2f")]
LATENCY_COLUMNS = [("backend", "backend", ""), ("tok_s", "tok/s", ".1f"), ("e2e_s", "e2e s", ".3f"),
                   ("ttft_ms", "TTFT ms", ".1f"), ("tpot_ms", "TPOT ms", ".2f"), ("ratio", "ratio", ".2f")]


def expert_balance(counts: dict[int, list[int]]) -> dict | None:
    """Load balance of a MoE run from the engine's expert counters (layer -> tokens per expert): max / mean tokens
    per expert over all layers together and in the worst layer. None for a dense model."""
    if not counts:
        return None

    def ratio(xs: list[int]) -> float:
        return max(xs) / (sum(xs) / len(xs)) if sum(xs) else 0.0

    worst = max(counts, key=lambda layer: ratio(counts[layer]))
    total = [sum(col) for col in zip(*counts.values())]
    return {"routed_tokens": sum(total), "max_over_mean": ratio(total), "worst_layer": worst,
            "worst_layer_max_over_mean": ratio(counts[worst]), "per_layer": counts}


def report_expert_balance(backends: list[Backend]) -> dict | None:
    """Print (and return) the expert load balance of the pagedlm backend's run, if its model has experts."""
    for b in backends:
        if hasattr(b, "llm") and hasattr(b.llm, "engine"):
            bal = expert_balance(b.llm.engine.get_stats().moe_expert_tokens)
            if bal:
                print(f"expert load ({b.name}, whole run): {bal['routed_tokens']:,} token-expert assignments, "
                      f"max/mean tokens per expert {bal['max_over_mean']:.2f} over all layers, "
                      f"{bal['worst_layer_max_over_mean']:.2f} in the worst layer ({bal['worst_layer']})")
            return bal
    return None


def environment() -> dict:
    return {"torch": torch.__version__, "threads": threads_note(), "machine": platform.machine(),
            "processor": platform.processor(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def plot_throughput(rows: list[ThroughputRow], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install matplotlib).")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r.backend for r in rows):
        pts = [(r.batch, r.output_tok_s) for r in rows if r.backend == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("generated tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_throughput(args, engine_kwargs: dict) -> int:
    kw = engine_kwargs(args)
    model, dtype = kw.pop("model"), kw.pop("dtype")
    backends = load_backends(args.backends.split(","), model, dtype, kw)
    vocab = _vocab_size(backends, model)
    sizes = args.batch_sizes or [args.num_prompts]
    rows = run_throughput(backends, vocab, sizes, args.input_len, args.output_len, args.repeats, args.seed)
    print(format_table([asdict(r) for r in rows], THROUGHPUT_COLUMNS))
    balance = report_expert_balance(backends)
    write_json(args.output_json, {"benchmark": "throughput", "model": model, "dtype": dtype,
                                  "input_len": args.input_len, "output_len": args.output_len,
                                  "repeats": args.repeats, "env": environment(), "rows": [asdict(r) for r in rows],
                                  "expert_balance": balance})
    if args.plot:
        plot_throughput(rows, args.plot)
    return 0


def cmd_latency(args, engine_kwargs: dict) -> int:
    kw = engine_kwargs(args)
    model, dtype = kw.pop("model"), kw.pop("dtype")
    backends = load_backends(args.backends.split(","), model, dtype, kw)
    vocab = _vocab_size(backends, model)
    rows = run_latency(backends, vocab, args.input_len, args.output_len, args.repeats, args.seed)
    print(format_table([asdict(r) for r in rows], LATENCY_COLUMNS))
    prefill = []
    if args.prefill_lens:
        prefill = run_prefill(backends, vocab, args.prefill_lens, args.prefill_repeats, args.seed)
        print(format_table([asdict(r) for r in prefill], PREFILL_COLUMNS))
    balance = report_expert_balance(backends)
    write_json(args.output_json, {"benchmark": "latency", "model": model, "dtype": dtype,
                                  "input_len": args.input_len, "output_len": args.output_len,
                                  "repeats": args.repeats, "env": environment(), "rows": [asdict(r) for r in rows],
                                  "prefill": [asdict(r) for r in prefill], "expert_balance": balance})
    return 0


def _vocab_size(backends: list[Backend], model: str) -> int:
    for b in backends:
        if hasattr(b, "vocab_size"):
            return b.vocab_size
    from pagedlm.config import ModelConfig
    from pagedlm.hub.loader import load_hf_config
    from pagedlm.hub.registry import resolve_model
    return ModelConfig.from_hf(load_hf_config(resolve_model(model))).vocab_size
