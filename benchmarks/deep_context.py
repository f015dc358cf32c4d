"""Decode deep in a long context, pagedlm against llama.cpp: one prompt of `--context` random token ids, then 64
single-token steps, each timed (the median reported), each engine in its own process. Unlike scale.py (which
prefills the prompt four times per run), the prompt is prefilled once, so 16k-token contexts take minutes, not an
hour. The GGUF must allow the context (scale.py --ctx-len writes a copy whose context_length says so).

    .venv/bin/python benchmarks/deep_context.py MODEL.gguf --context 16384 --engines pagedlm,llama.cpp
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

STEPS = 64


def child(engine: str, path: str, n: int) -> str:
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(n)]
    steps = []
    if engine == "pagedlm":
        from pagedlm import LLM, SamplingParams

        eng = LLM(model=path, max_model_len=n + 128, speculative_config=None).engine  # one token per step, as llama.cpp
        t = time.perf_counter()
        eng.add_request("deep", ids, SamplingParams(max_tokens=STEPS + 16, temperature=0.0, ignore_eos=True))
        while not any(d.token_ids for o in eng.step() for d in o.outputs):
            pass
        prefill = time.perf_counter() - t
        for _ in range(STEPS):
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
    else:
        from llama_cpp import Llama

        llm = Llama(model_path=path, n_ctx=n + 128, n_threads=2, n_batch=512, verbose=False)
        t = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - t
        for _ in range(STEPS):
            t = time.perf_counter()
            llm.eval([1000])
            steps.append(time.perf_counter() - t)
    return (f"| {engine} | {n} | {n / prefill:.1f} ({prefill:.0f} s) | {1 / statistics.median(steps):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--engines", default="pagedlm,llama.cpp")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(child(a.child, a.model, a.context))
        return
    print("| engine | context | prefill tok/s | decode tok/s (median of 64 steps) |\n|---|---|---|---|")
    for engine in a.engines.split(","):
        out = subprocess.run([sys.executable, __file__, a.model, "--context", str(a.context), "--child", engine],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
