"""Start-up of `LLM(model=path)` at 1B-8B, for one or more source trees (this one, main's), each start in a fresh
process, trees alternated: the first start of a model file (its tokenizer not yet converted, no repacked-weight
cache: what a start after a download pays) and the second (both cached). Kernels and the probe are cached as after
any start on the machine; the model file is in the page cache, as it is for the peers' figures.

    .venv/bin/python benchmarks/startup.py --shapes 1b,3b --trees new=src,main=../main/src --repeats 3

`load` is benchmarks/scale.py's load time (torch already imported: `from pagedlm import LLM` and `LLM(model=path)`,
as llama.cpp's figure is `import llama_cpp` and `Llama(path)`); `process` is the whole child from its exec to ready
(Python and torch imports included); `exit` how long the child took to exit once ready (a first start writes the
repacked-weight cache then, on a thread of its own); peak RSS at ready; `first request` the time of the first
request once ready (a fresh 32-token prompt, one token: its time to first token). With `--llama-cpp`, llama.cpp's
load of the same file is alternated with them (llama-cpp-python: `import llama_cpp` and `Llama(path)` as
benchmarks/scale.py loads it, torch imported before its clock too; it keeps no cache, so it has one kind of start).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scale import ensure_model

FORGET = """
import sys
from pathlib import Path
try:
    from pagedlm.engine.model_runner import weight_cache_dir
    from pagedlm.model.weight_cache import cache_file
except ImportError:  # a tree without the cache
    sys.exit(0)
cache_file(weight_cache_dir("auto"), Path(sys.argv[1])).unlink(missing_ok=True)
"""


def _hwm() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))


def child(path: str, engine: str) -> dict:
    import random

    import torch  # noqa: F401  (imported before the clock starts, as in scale.py)

    prompt = [random.Random(time.time_ns()).randrange(100, 40000) for _ in range(32)]
    if engine == "llama.cpp":
        from pagedlm.bench.backends import LlamaCppBackend  # pagedlm's module, outside llama.cpp's clock

        t0 = time.perf_counter()
        llm = LlamaCppBackend(Path(path))
        load = time.perf_counter() - t0
        ready_at, hwm = time.time(), _hwm()
        t = time.perf_counter()
        llm.generate([prompt], 1)
    else:
        t0 = time.perf_counter()
        from pagedlm import LLM, SamplingParams

        llm = LLM(model=path)
        load = time.perf_counter() - t0
        ready_at, hwm = time.time(), _hwm()
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - t
    return {"load_s": load, "ready_at": ready_at, "peak_rss": hwm, "first_s": first, "peak_rss_after": _hwm()}


def start(tree: Path, path: Path, first: bool, engine: str = "pagedlm") -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if first:
        shutil.rmtree(path.with_name(path.name + ".tokenizer"), ignore_errors=True)
        subprocess.run([sys.executable, "-c", FORGET, str(path)], env=env, check=True)
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, "--child", str(path), "--engine", engine], env=env,
                         capture_output=True, text=True)
    end = time.time()
    if out.returncode:
        raise SystemExit(f"{tree} on {path.name} failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {**r, "process_s": r["ready_at"] - t0, "exit_s": end - r["ready_at"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,3b")
    ap.add_argument("--quant", default="Q4_0")
    ap.add_argument("--trees", default="new=src", help="name=source tree, comma separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "pagedlm" / "scale")
    ap.add_argument("--llama-cpp", action="store_true", help="alternate llama.cpp's load of the same file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="pagedlm", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.engine)))
        return
    trees = {name: Path(src).resolve() for name, src in (t.split("=", 1) for t in a.trees.split(","))}
    print("| model | tree | start | load s (median; all) | process s | exit s | first request s | "
          "peak RSS GB at ready / after the first request |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        path = ensure_model(a.dir, shape, a.quant)
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(a.repeats):
            for name, tree in trees.items():
                for which in ("first", "second"):
                    runs.setdefault((name, which), []).append(start(tree, path, which == "first"))
            if a.llama_cpp:
                runs.setdefault(("llama.cpp", "any"), []).append(
                    start(next(iter(trees.values())), path, False, "llama.cpp"))
        for (name, which), rs in runs.items():
            def med(key: str) -> float:
                return statistics.median(r[key] for r in rs)
            loads = " / ".join(f"{r['load_s']:.2f}" for r in rs)
            print(f"| {shape} {a.quant} | {name} | {which} | **{med('load_s'):.2f}**; {loads} | "
                  f"{med('process_s'):.2f} | {med('exit_s'):.2f} | {med('first_s'):.3f} | "
                  f"{med('peak_rss') / 1e9:.2f} / {med('peak_rss_after') / 1e9:.2f} |")


if __name__ == "__main__":
    main()
