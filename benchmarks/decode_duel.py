"""Single-stream decode, pagedlm against llama.cpp on the same GGUF file, both engines in this process and
alternated round by round: each round decodes `--tokens` greedy tokens with one engine, then the other, so both see
the same state of a shared host, whose read bandwidth can drift by a third within minutes (benchmarks/scale.py
runs each engine in its own process, minutes apart). The ratio is taken per round, then the median over rounds.

    .venv/bin/python benchmarks/decode_duel.py ~/.cache/pagedlm/scale/random-1b-Q4_K_M.gguf --rounds 8

A round's rate is `tokens / (time of a (tokens + 1)-token request - time of a 1-token request)` after the same
`--context`-token prompt, as scale.py measures decode (prefill and the first token out of it). Speculative decoding
is off in pagedlm: one token per read of the weights, as llama.cpp decodes. Both engines use torch's thread count.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .gguf file")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedlm.bench.backends import make_backend

    engines = {"pagedlm": make_backend("pagedlm", args.model, "auto", {"speculative_config": None}),
               "llama.cpp": make_backend("llama.cpp", args.model, "auto", {})}
    rng = random.Random(0)

    def timed(engine, n_new: int) -> float:
        ids = [rng.randrange(100, 40000) for _ in range(args.context)]
        t = time.perf_counter()
        engine.generate([ids], n_new)
        return time.perf_counter() - t

    for engine in engines.values():  # first-call costs (kernel binding, thread pools) out of the timings
        timed(engine, 4)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            rates[name].append(args.tokens / (timed(engine, args.tokens + 1) - timed(engine, 1)))
    ratios = [a / b for a, b in zip(rates["pagedlm"], rates["llama.cpp"])]
    print(f"{args.model}: {args.rounds} rounds of {args.tokens} tokens, {torch.get_num_threads()} threads")
    for name, r in rates.items():
        print(f"  {name:9s} tok/s median {statistics.median(r):6.1f}  ({' '.join(f'{x:.1f}' for x in r)})")
    print(f"  pagedlm / llama.cpp per round: median {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
