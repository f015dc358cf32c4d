"""Perplexity of a GGUF on `tests/data/perplexity.txt` for pagedlm's fp32 path (the file's exact weights), its
default path and llama.cpp (llama-cpp-python, the `llamacpp` extra), on the same token ids in the same 512-token
windows; and each path's drift: the mean |change| of the tokens' log-probabilities against the fp32 path.
`pagedlm-avx2` is the default path as an AVX2-only CPU runs it (PAGEDLM_ISA=avx2, see pagedlm/cpu.py).

    .venv/bin/python benchmarks/perplexity.py smollm2-135m gemma3-270m
    .venv/bin/python benchmarks/perplexity.py gemma3-270m --engines pagedlm-fp32,pagedlm,pagedlm-avx2

Each engine runs in a fresh process (`--child`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "perplexity.txt"
WINDOW = 512


def _windows(ids: list[int]) -> list[list[int]]:
    return [c for c in (ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW)) if len(c) > 1]


def child(engine: str, model: str) -> list[float]:
    from pagedlm import LLM
    from pagedlm.bench.quality import token_logprobs
    from pagedlm.hub.registry import resolve_model
    from pagedlm.hub.tokenizer import load_tokenizer

    path = resolve_model(model)
    ids = load_tokenizer(path).encode(TEXT.read_text())
    if engine.startswith("pagedlm"):
        llm = LLM(str(path), kv_cache_memory="256MiB", **({"dtype": "float32"} if engine == "pagedlm-fp32" else {}))
        return token_logprobs(llm, ids, WINDOW)
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2 * WINDOW, n_batch=WINDOW, logits_all=True, n_threads=2, verbose=False)
    out = []
    for chunk in _windows(ids):
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:len(chunk)], dtype=np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        out += [float(logp[i, chunk[i + 1]]) for i in range(len(chunk) - 1)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--engines", default="pagedlm-fp32,pagedlm,llama.cpp")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "MODEL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    from pagedlm.bench.quality import logprob_drift

    print("| model | engine | perplexity | drift vs fp32 |\n|---|---|---|---|")
    for model in a.models:
        runs = {}
        for engine in a.engines.split(","):
            env = {**os.environ, "PAGEDLM_ISA": "avx2" if engine == "pagedlm-avx2" else "native"}
            out = subprocess.run([sys.executable, __file__, "--child", engine, model], capture_output=True, text=True,
                                 env=env)
            if out.returncode:
                raise SystemExit(f"{engine} on {model} failed:\n{out.stderr[-3000:]}")
            runs[engine] = json.loads(out.stdout.strip().splitlines()[-1])
        base = runs.get("pagedlm-fp32")
        for engine, lps in runs.items():
            drift = f"{logprob_drift(lps, base):.3f}" if base and engine != "pagedlm-fp32" else ""
            print(f"| {model} | {engine} | {math.exp(-sum(lps) / len(lps)):.3f} | {drift} |")


if __name__ == "__main__":
    main()
