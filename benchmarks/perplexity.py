"""Perplexity of a GGUF on `tests/data/perplexity.txt` for pagedlm's fp32 path (the file's exact weights), its
default path and llama.cpp (llama-cpp-python, the `llamacpp` extra), on the same token ids in the same 512-token
windows; each path's drift: the mean |change| of the tokens' log-probabilities against the fp32 path; and each
path's perplexity against llama.cpp's (`--against`) with the standard error of that ratio, from the paired
per-token differences. `pagedlm-avx2` is the default path as an AVX2-only CPU runs it (PAGEDLM_ISA=avx2, see
pagedlm/cpu.py); `pagedlm-layers` the default path with the fused decoder stack off: the same kernels and
roundings, the fp32 sums between them in another order. `--draws N` runs each engine N times more with its input
embeddings scaled by 1 + 1e-6 x noise (a seed per draw; llama.cpp takes them as `llama_batch.embd`) and prints the
draws' mean and standard deviation.

    .venv/bin/python benchmarks/perplexity.py smollm2-135m gemma3-270m
    .venv/bin/python benchmarks/perplexity.py gemma3-270m --engines pagedlm-fp32,pagedlm,pagedlm-layers,llama.cpp

Why the standard error: with activations quantized to 8 bits at each product (llama.cpp's GGUF kernels and
pagedlm's alike), which way single activations round decides part of each token's log-probability, and a last-bit
change upstream (a sum in another order) redraws those roundings downstream. Two exact implementations of the same
quantized arithmetic then differ per token about as much as either differs from fp32, and on a text of a few
thousand tokens their perplexities differ by about the standard error printed here; the draws show the same spread
within one engine (an fp32 path's draws agree to about 1e-6).

Each engine runs in a fresh process (`--child`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "perplexity.txt"
WINDOW = 512


def _windows(ids: list[int]) -> list[list[int]]:
    return [c for c in (ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW)) if len(c) > 1]


JITTER = 1e-6  # the draws' relative change of the embeddings


def child(engine: str, model: str, draws: int) -> list[list[float]]:
    """The tokens' log-probabilities, for each of 1 + `draws` runs (llama.cpp's draws give it the embeddings
    instead of the tokens, jittered the same way)."""
    import torch

    from pagedlm import LLM
    from pagedlm.bench.quality import token_logprobs
    from pagedlm.hub.registry import resolve_model
    from pagedlm.hub.tokenizer import load_tokenizer

    path = resolve_model(model)
    ids = load_tokenizer(path).encode(TEXT.read_text())
    if engine.startswith("pagedlm"):
        llm = LLM(str(path), kv_cache_memory="256MiB", enable_prefix_caching=False,
                  **({"dtype": "float32"} if engine == "pagedlm-fp32" else {}))
        model = llm.engine.runner.model
        if engine == "pagedlm-layers":
            model._decode_kernel = None  # layer by layer
        embed, runs = model.embed, []
        for draw in range(1 + draws):
            noise = torch.Generator().manual_seed(draw)
            if draw:
                model.embed = lambda ids: (x := embed(ids)) * (1 + JITTER * torch.randn(x.shape, generator=noise))
            runs.append(token_logprobs(llm, ids, WINDOW))
        return runs
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2 * WINDOW, n_batch=WINDOW, logits_all=True, n_threads=2, verbose=False)
    runs = [[]]
    for chunk in _windows(ids):
        llm.reset()
        llm.eval(chunk)
        runs[0] += _chunk_logprobs(np.asarray(llm.scores[:len(chunk)]), chunk)
    if draws:
        table, scale = _embedding_rows(path)
        for draw in range(1, 1 + draws):
            noise, run = np.random.default_rng(draw), []
            for chunk in _windows(ids):
                x = table(chunk) * scale
                run += _chunk_logprobs(_llama_cpp_logits(llm, x * (1 + JITTER * noise.standard_normal(x.shape))),
                                       chunk)
            runs.append(run)
    return runs


def _chunk_logprobs(logits, chunk: list[int]) -> list[float]:
    import numpy as np

    logits = np.asarray(logits, dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return [float(logp[i, chunk[i + 1]]) for i in range(len(chunk) - 1)]


def _embedding_rows(path: Path):
    """The GGUF's token embedding rows as fp32 (gguf-py dequantizes them) and the factor llama.cpp multiplies token
    embeddings by in its graph, which it leaves out for embeddings given as input (Gemma: sqrt(hidden))."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    arch = str(reader.fields["general.architecture"].contents())
    hidden = int(t.shape[0])
    scale = np.float32(np.sqrt(np.float32(hidden))) if arch.startswith("gemma") else np.float32(1)
    data = np.asarray(t.data)
    return (lambda rows: dequantize(data[rows], t.tensor_type).reshape(len(rows), hidden).astype(np.float32)), scale


def _llama_cpp_logits(llm, x):
    """Logits of every position of one sequence given as input embeddings x [n, hidden] (a fresh KV cache)."""
    import llama_cpp as lc
    import numpy as np

    n, hidden = x.shape
    ctx = llm._ctx.ctx
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    batch = lc.llama_batch_init(n, hidden, 1)
    try:
        np.ctypeslib.as_array(batch.embd, shape=(n * hidden,))[:] = x.astype(np.float32).ravel()
        for i in range(n):
            batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = i, 1, 0, 1
        batch.n_tokens = n
        if lc.llama_decode(ctx, batch):
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n, llm.n_vocab())).copy()
    finally:
        lc.llama_batch_free(batch)


def ratio_with_error(logprobs: list[float], baseline: list[float]) -> tuple[float, float]:
    """perplexity(logprobs) / perplexity(baseline) - 1 on the same tokens, and its standard error (the paired
    per-token differences' standard deviation over sqrt(n), carried through exp)."""
    diff = [b - a for a, b in zip(logprobs, baseline, strict=True)]
    ratio = math.exp(statistics.fmean(diff))
    return ratio - 1, ratio * statistics.stdev(diff) / math.sqrt(len(diff))


def means_ratio(draws: list[float], baseline: list[float]) -> tuple[float, float]:
    """mean(draws) / mean(baseline) - 1 and its standard error, from the two sets of draws' perplexities."""
    m, b = statistics.fmean(draws), statistics.fmean(baseline)
    rel = math.hypot(statistics.stdev(draws) / m, statistics.stdev(baseline) / b)
    return m / b - 1, m / b * rel / math.sqrt(min(len(draws), len(baseline)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--engines", default="pagedlm-fp32,pagedlm,llama.cpp")
    ap.add_argument("--against", default="llama.cpp", help="the engine the last column compares with")
    ap.add_argument("--draws", type=int, default=0,
                    help="runs of each engine with jittered input embeddings, beyond the first")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "MODEL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child, a.draws)))
        return
    from pagedlm.bench.quality import logprob_drift

    print(f"| model | engine | perplexity | drift vs fp32 | against {a.against} (± standard error) |"
          f"{' draws: mean ± sd (against ' + a.against + ') |' if a.draws else ''}\n"
          f"|---|---|---|---|---|{'---|' if a.draws else ''}")
    for model in a.models:
        runs = {}
        for engine in a.engines.split(","):
            env = {**os.environ, "PAGEDLM_ISA": "avx2" if engine == "pagedlm-avx2" else "native"}
            out = subprocess.run([sys.executable, __file__, "--child", engine, model, "--draws", str(a.draws)],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                raise SystemExit(f"{engine} on {model} failed:\n{out.stderr[-3000:]}")
            runs[engine] = json.loads(out.stdout.strip().splitlines()[-1])
        first = {engine: draws[0] for engine, draws in runs.items()}
        base, against = first.get("pagedlm-fp32"), first.get(a.against)
        for engine, lps in first.items():
            drift = f"{logprob_drift(lps, base):.3f}" if base and engine != "pagedlm-fp32" else ""
            versus = ""
            if against and engine != a.against:
                ratio, err = ratio_with_error(lps, against)
                versus = f"{100 * ratio:+.2f}% ± {100 * err:.2f}%"
            spread = ""
            if a.draws:
                ppl = [math.exp(-statistics.fmean(run)) for run in runs[engine]]
                spread = f" {statistics.fmean(ppl):.3f} ± {statistics.stdev(ppl):.3f}"
                if a.against in runs and engine != a.against:
                    ratio, err = means_ratio(ppl, [math.exp(-statistics.fmean(run)) for run in runs[a.against]])
                    spread += f" ({100 * ratio:+.2f}% ± {100 * err:.2f}%)"
                spread += " |"
            print(f"| {model} | {engine} | {math.exp(-sum(lps) / len(lps)):.3f} | {drift} | {versus} |{spread}")


if __name__ == "__main__":
    main()
