"""What quantization buys and costs, every setting against the baseline in the same run:
KV tokens that fit in a fixed budget, single-stream decode tok/s, batch throughput, perplexity on a fixed text
and greedy agreement with the baseline (chat prompts, EOS ignored). Speed runs alternate between settings so
that machine noise hits them alike; medians of --repeats.

    .venv/bin/python benchmarks/quantization.py [--repeats 3] [--batch 64] [--output-len 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from pagedlm import LLM, SamplingParams
from pagedlm.bench.common import format_table, make_prompts
from pagedlm.bench.quality import Agreement, greedy_outputs, perplexity, quality_prompts
from pagedlm.config import DEFAULT_MODEL, parse_bytes

SETTINGS = {
    "fp32 (baseline)": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "kv int8": dict(dtype="float32", kv_cache_dtype="int8"),
    "kv fp8_e4m3": dict(dtype="float32", kv_cache_dtype="fp8_e4m3"),
    "w int8": dict(dtype="float32", quantization="int8"),
    "w int4": dict(dtype="float32", quantization="int4"),
    "w int4 + kv int8": dict(dtype="float32", quantization="int4", kv_cache_dtype="int8"),
}
TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity.txt"


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma list of: " + ", ".join(SETTINGS))
    ap.add_argument("--kv-budget", default="1GiB", help="KV cache budget for the capacity column and every engine")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--latency-len", type=int, default=128, help="single-stream output tokens")
    ap.add_argument("--quality-prompts", type=int, default=64)
    ap.add_argument("--quality-tokens", type=int, default=64)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [s.strip() for s in args.settings.split(",")]
    llms = {n: LLM(args.model, kv_cache_memory=parse_bytes(args.kv_budget), **SETTINGS[n]) for n in names}
    rows = {n: {"setting": n, "kv_tokens": llm.engine.memory_report.tokens_capacity,
                "kv_bytes_per_token": llm.engine.memory_report.kv_bytes_per_token} for n, llm in llms.items()}
    base = names[0]
    vocab = llms[base].engine.model_config.vocab_size
    eos = sorted(llms[base].engine.eos_token_ids)
    batch = make_prompts(vocab, args.batch, args.input_len, seed=1, avoid=eos)
    single = make_prompts(vocab, 1, args.input_len, seed=2, avoid=eos)
    lat: dict[str, list[float]] = {n: [] for n in names}
    thr: dict[str, list[float]] = {n: [] for n in names}
    for llm in llms.values():  # warm-up (kernels built, allocator warm)
        timed(llm, single, 8)
    for r in range(args.repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            lat[n].append(timed(llms[n], single, args.latency_len))
            thr[n].append(timed(llms[n], batch, args.output_len))
            print(f"  repeat {r + 1}: {n:<18} single {lat[n][-1]:6.1f} tok/s   batch {thr[n][-1]:6.1f} tok/s",
                  flush=True)
    for n in names:
        rows[n]["single_tok_s"] = statistics.median(lat[n])
        rows[n]["batch_tok_s"] = statistics.median(thr[n])
    if not args.skip_quality:
        text = TEXT.read_text()
        prompts = quality_prompts(args.quality_prompts)
        ref = None
        for n, llm in llms.items():
            rows[n]["perplexity"] = perplexity(llm, llm.get_tokenizer().encode(text))
            outs = greedy_outputs(llm, prompts, args.quality_tokens)
            ref = ref or outs
            agree = Agreement.of(ref, outs)
            rows[n]["identical"], rows[n]["prefix_agreement"] = agree.identical, agree.prefix
            print(f"  quality: {n:<18} ppl {rows[n]['perplexity']:.3f}  identical {agree.identical:.2f}  "
                  f"prefix {agree.prefix:.3f}", flush=True)
    b = rows[base]
    for row in rows.values():
        row["kv_tokens_x"] = row["kv_tokens"] / b["kv_tokens"]
        row["single_x"] = row["single_tok_s"] / b["single_tok_s"]
        row["batch_x"] = row["batch_tok_s"] / b["batch_tok_s"]
        if "perplexity" in row:
            row["ppl_change_pct"] = 100 * (row["perplexity"] / b["perplexity"] - 1)
    cols = [("setting", "setting", ""), ("kv_bytes_per_token", "KV B/token", ","), ("kv_tokens", "KV tokens", ","),
            ("kv_tokens_x", "x", ".2f"), ("single_tok_s", "1-stream tok/s", ".1f"), ("single_x", "x", ".2f"),
            ("batch_tok_s", f"batch-{args.batch} tok/s", ".1f"), ("batch_x", "x", ".2f")]
    if not args.skip_quality:
        cols += [("perplexity", "ppl", ".3f"), ("ppl_change_pct", "ppl %", "+.2f"),
                 ("prefix_agreement", f"agree ({args.quality_prompts}x{args.quality_tokens})", ".3f"),
                 ("identical", "identical", ".2f")]
    print(f"\n{args.model}, KV budget {args.kv_budget}, threads {torch.get_num_threads()}, medians of {args.repeats}; "
          f"single stream: {args.input_len} -> {args.latency_len} tokens; batch: {args.batch} x "
          f"({args.input_len} -> {args.output_len}); x = ratio to {base}")
    print(format_table(list(rows.values()), cols))
    if args.json:
        Path(args.json).write_text(json.dumps(list(rows.values()), indent=2))
    del llms
    gc.collect()


if __name__ == "__main__":
    main()
