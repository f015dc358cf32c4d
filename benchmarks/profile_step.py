"""Profile decode steps of the engine: where the time of one step goes (torch profiler, by op), or with
`--wall` the median wall time of a step without the profiler (compare two source trees by running it with
PYTHONPATH=<tree>/src alternately).

    .venv/bin/python benchmarks/profile_step.py --batch 64 --context 160 --steps 5 [--threads 2]
    .venv/bin/python benchmarks/profile_step.py --batch 16 --steps 8 --wall
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import profile

from pagedlm import LLM, SamplingParams
from pagedlm.config import DEFAULT_MODEL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=160, help="prompt tokens before the profiled decode steps")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--wall", action="store_true", help="median wall time per step, no profiler")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, attention_backend=args.attention_backend)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 3, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"p{i}", [100 + (i * 31 + j) % 20000 for j in range(args.context)], params)
    while eng.scheduler.waiting:  # prefill everything first
        eng.step()
    eng.step()
    if args.wall:
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        dt = statistics.median(times)
        print(f"decode step, batch {args.batch}, context {args.context}: median {dt * 1e3:.1f} ms "
              f"({args.batch / dt:.0f} tok/s), threads {torch.get_num_threads()}")
        return
    t0 = time.perf_counter()
    with profile() as prof:
        for _ in range(args.steps):
            eng.step()
    dt = (time.perf_counter() - t0) / args.steps
    print(f"decode step, batch {args.batch}: {dt * 1e3:.1f} ms/step under the profiler "
          f"({args.batch / dt:.0f} tok/s), threads {torch.get_num_threads()}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    while eng.has_unfinished_requests():
        eng.step()


if __name__ == "__main__":
    main()
