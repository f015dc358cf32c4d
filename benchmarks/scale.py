"""Models at the sizes people run: load time, peak RSS, decode against the memory-bandwidth limit, and prefill, for
random-weight GGUFs of real shapes (speed and memory do not depend on the values), each engine in a fresh process,
engines alternated.

    .venv/bin/python benchmarks/scale.py --shapes 1b,3b --quant Q4_0 --backends pagedlm,llama.cpp --repeats 2

Models are written once into `--dir` by ../shared/tools/make-scale-model.py (1b: TinyLlama-1.1B's shape, 3b:
Llama-3.2-3B's, 8b: Llama-3.1-8B's; SmolLM2's tokenizer, so both engines load the same file). The decode rate is
128 / (time of a 129-token generation - time of a 1-token one) on a fresh random prompt of `--context` tokens (32;
4096 for decode deep in a context, where attention and its KV reads grow); the limit is the
file's bytes read once per token at the read bandwidth measured just before each run (a sum over a buffer far larger
than the caches, with torch's threads); "of limit" is the median over runs of decode / that run's limit.
`pagedlm` runs its defaults (`LLM(model=path)`) but for speculative decoding, which is off here (a random-weight
model's greedy output repeats, so drafts would be accepted and the rate would no longer be one token per read of the
weights); `llama.cpp` is llama-cpp-python (the `llamacpp` extra). Peak RSS is the child's high-water mark (VmHWM).
The file is read through once before the first run, so every engine starts from it in the page cache (otherwise the
first engine of the first repetition pays the disk read for both); pagedlm's first start is its first repetition,
where it writes its repacked-weight cache (remove ~/.cache/pagedlm/weights to measure it again).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAKE_MODEL = ROOT.parent / "shared" / "tools" / "make-scale-model.py"


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def child(backend: str, path: str, prefill: int, seed: int, context: int = 32) -> dict:
    """One engine in this process: load, decode after a `context`-token prompt, prefill."""
    import torch

    # The load is each engine's own work, torch imported before it for both: pagedlm's package imports and
    # `LLM(model=path)`; llama.cpp's `import llama_cpp` and `Llama(path)` (pagedlm's modules outside its clock).
    if backend != "pagedlm":
        import pagedlm.bench.backends  # noqa: F401
    t0 = time.perf_counter()
    from pagedlm.bench.backends import make_backend

    engine = make_backend(backend, path, "auto", {"speculative_config": None} if backend == "pagedlm" else {})
    load = time.perf_counter() - t0
    rng = random.Random(seed)

    def run(n_prompt: int, n_new: int) -> float:
        ids = [rng.randrange(100, 40000) for _ in range(n_prompt)]
        t = time.perf_counter()
        engine.generate([ids], n_new)
        return time.perf_counter() - t

    run(8, 2)  # first-call costs (kernel binding, thread pools) out of the timings
    decode = [128 / (run(context, 129) - run(context, 1)) for _ in range(2)]
    pre = prefill / run(prefill, 1)
    return {"load_s": load, "peak_rss": _hwm(), "decode": max(decode), "prefill": pre,
            "threads": torch.get_num_threads()}


class Bandwidth:
    """Read bandwidth: bytes per second of a threaded sum over 2 GiB (far past the last-level cache), the best of
    five; measured again before every run, since a shared host's bandwidth drifts by a third within minutes."""

    def __init__(self) -> None:
        import torch

        self.buf = torch.ones(2**29)
        self.buf.sum()

    def __call__(self) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            self.buf.sum()
            times.append(time.perf_counter() - t)
        return self.buf.numel() * 4 / min(times)


def ensure_model(directory: Path, shape: str, quant: str, ctx: int = 0) -> Path:
    """The model file (written once); with `ctx`, a copy whose llama.context_length says `ctx` (the generated files
    say 8,192; random weights have no trained context to exceed), for decode deep in longer contexts."""
    path = directory / f"random-{shape}-{quant}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(MAKE_MODEL), shape, quant, str(path)], check=True)
    if not ctx:
        return path
    longer = directory / f"random-{shape}-{quant}-ctx{ctx}.gguf"
    if not longer.exists():
        data = bytearray(path.read_bytes())
        key = b"llama.context_length"
        at = data.index(len(key).to_bytes(8, "little") + key) + 8 + len(key)
        assert int.from_bytes(data[at:at + 4], "little") == 4  # GGUF value type uint32
        data[at + 4:at + 8] = ctx.to_bytes(4, "little")
        tmp = longer.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(longer)
    return longer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,3b")
    ap.add_argument("--quant", default="Q4_0")
    ap.add_argument("--backends", default="pagedlm")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--context", type=int, default=32, help="prompt tokens before the timed decode (long contexts)")
    ap.add_argument("--ctx-len", type=int, default=0, help="a copy of the file saying this context length (16k+)")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "pagedlm" / "scale")
    ap.add_argument("--child", nargs=3, metavar=("BACKEND", "PATH", "SEED"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.prefill, int(a.child[2]), a.context)))
        return
    from pagedlm.cpu import cpu_features

    bandwidth = Bandwidth()
    print(f"CPU flags: {cpu_features().describe()}; read bandwidth {bandwidth() / 1e9:.1f} GB/s")
    print("| model | file | engine | load s | peak RSS GB | decode tok/s | of limit | prefill tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        path = ensure_model(a.dir, shape, a.quant, a.ctx_len)
        size = path.stat().st_size
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        runs: dict[str, list[dict]] = {b: [] for b in a.backends.split(",")}
        for r in range(a.repeats):
            for backend in runs:
                bw = bandwidth()
                out = subprocess.run([sys.executable, __file__, "--prefill", str(a.prefill), "--context",
                                      str(a.context), "--child", backend, str(path), str(r)],
                                     capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{backend} on {path.name} failed:\n{out.stderr[-3000:]}")
                runs[backend].append({**json.loads(out.stdout.strip().splitlines()[-1]), "limit": bw / size})
        for backend, rs in runs.items():
            def col(key: str, fmt: str) -> str:
                return " / ".join(fmt.format(x[key]) for x in rs)
            share = statistics.median(x["decode"] / x["limit"] for x in rs)
            limits = " / ".join(f"{x['limit']:.1f}" for x in rs)
            rss = " / ".join(f"{x['peak_rss'] / 1e9:.2f}" for x in rs)
            print(f"| {shape} {a.quant} | {size / 1e9:.2f} GB | {backend} | {col('load_s', '{:.1f}')} | {rss} | "
                  f"{col('decode', '{:.1f}')} | {share:.0%} (limit {limits}) | {col('prefill', '{:.0f}')} |")


if __name__ == "__main__":
    main()
