"""Wall time of engine decode steps at a fixed batch size (no profiler): medians of `--steps` steps after every
prompt is prefilled. Compare two source trees by running it with PYTHONPATH=<tree>/src alternately.

    .venv/bin/python benchmarks/step_time.py --batch 16 --context 160 --steps 8
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedlm import LLM, SamplingParams
from pagedlm.config import DEFAULT_MODEL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=160, help="prompt tokens before the timed decode steps")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    eng = LLM(args.model, dtype=args.dtype).engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 3, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"p{i}", [100 + (i * 31 + j) % 20000 for j in range(args.context)], params)
    while eng.scheduler.waiting:  # prefill everything first
        eng.step()
    eng.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    print(f"decode step, batch {args.batch}, context {args.context}: median {statistics.median(times) * 1e3:.1f} ms "
          f"({args.batch / statistics.median(times):.0f} tok/s)")
    while eng.has_unfinished_requests():
        eng.step()


if __name__ == "__main__":
    main()
