"""The prefix cache's disk tier (--kv-cache-dir): TTFT from disk after a restart, a multi-turn chat replayed
after a restart, and what writing every full block costs a busy engine when nothing hits.

TTFT (default), per prompt length: engine A (with the disk tier) prefills a random prompt and writes its blocks
(its TTFT: recompute plus the write-through copy); engine C (no disk tier) prefills it again (TTFT: recompute);
engine B, a new engine on the same directory (a restart), serves it from disk (TTFT: load). `--cold` drops the
files from the page cache first (posix_fadvise DONTNEED, no root needed), so that B reads the disk itself. Also
printed: the disk's own sequential read rate over the same files (cold when --cold) beside the rate the loads
achieved. `--sides` runs some of A, C, B (write, recompute, disk) per call, on files kept under `--dir`, to split
a long run. A GGUF whose context is shorter than the prompt is copied once, its context length raised, into the
model cache (random weights have no trained context to exceed).

`--multi-turn`: an 8-turn chat whose context grows (each turn appends the previous answer and a new user message),
first run by an engine with the disk tier (which fills it), then replayed alternately by a restarted engine with
the disk tier and by one without; total and TTFT summed over the turns.

`--write-cost`: throughput of a batch of distinct random prompts (nothing hits) with the disk tier on (write-through
of every full block the write budget admits, `--wc-share` setting it; 1: all) and off, two engines alternated over
--repeats, new prompts each time; medians.

    .venv/bin/python benchmarks/disk_cache.py --prompt-lens 4096 --cold
    .venv/bin/python benchmarks/disk_cache.py --model path/to/1b.gguf --prompt-lens 4096,16384 --cold
    .venv/bin/python benchmarks/disk_cache.py --model path/to/1b.gguf --prompt-lens 16384 --cold --dir D --sides write
    .venv/bin/python benchmarks/disk_cache.py --multi-turn --cold --repeats 3
    .venv/bin/python benchmarks/disk_cache.py --write-cost --repeats 5
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from pagedlm.config import DEFAULT_MODEL
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.hub.gguf_file import read_gguf
from pagedlm.hub.registry import resolve_model
from pagedlm.paths import cache_dir
from pagedlm.sampling.params import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
VOCAB = 10_000  # prompts are random token ids below this


def ttft(eng: LLMEngine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    eng.add_request(f"b{time.monotonic_ns()}", prompt, ONE)
    while eng.has_unfinished_requests():
        if any(o.outputs and o.outputs[0].token_ids for o in eng.step()):
            return time.perf_counter() - t0
    return time.perf_counter() - t0


def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate(files: list[Path]) -> float:
    """Bytes/s of reading every file once, sequentially, 8 MiB at a time."""
    buf = bytearray(8 << 20)
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total / max(time.perf_counter() - t0, 1e-9)


def run_files(d: Path) -> list[Path]:
    seen: dict[int, Path] = {}
    for p in d.rglob("*.kv"):
        seen.setdefault(p.stat().st_ino, p)
    return list(seen.values())


def long_enough(model: str, need: int) -> str:
    """`model`, or a copy of its GGUF whose context length says the next power of two >= `need` (written once,
    beside it when it lives in the model cache, else in the cache)."""
    path = resolve_model(model)
    if path.suffix != ".gguf":
        return model
    gguf = read_gguf(path)
    key = f"{gguf.fields['general.architecture']}.context_length"
    if gguf.fields.get(key, 0) >= need:
        return str(path)
    ctx = 1 << (need - 1).bit_length()
    home = cache_dir()
    longer = (path.parent if path.resolve().is_relative_to(home.resolve()) else home) / f"{path.stem}-ctx{ctx}.gguf"
    if not longer.exists():
        data = bytearray(path.read_bytes())
        name = key.encode()
        at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
        width = {4: 4, 10: 8}[int.from_bytes(data[at:at + 4], "little")]  # GGUF uint32 or uint64
        data[at + 4:at + 4 + width] = ctx.to_bytes(width, "little")
        tmp = longer.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(longer)
    return str(longer)


def served(model: str, kw: dict, prompt: list[int], disk_dir: Path | None):
    """TTFT of `prompt` on a new engine (with the disk tier in `disk_dir` when given), and its disk stats."""
    eng = LLMEngine.from_args(model, **kw, **({"kv_cache_dir": str(disk_dir)} if disk_dir else {}))
    seconds = ttft(eng, prompt)
    disk = eng.get_stats().disk
    eng.close()
    return seconds, disk


def one(args, model: str, length: int, cache_dir: Path) -> dict:
    rng = random.Random(length)
    engine_kw = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=length + 16,
                     max_num_seqs=2)  # a pool of two sequences: one cached prefix is revived whole beside the watermark
    prompt = [rng.randrange(100, VOCAB) for _ in range(length)]
    row: dict = {"prompt_len": length, "cold": args.cold, "kv_dtype": args.kv_cache_dtype}
    if "write" in args.sides:
        row["ttft_recompute_and_write_s"] = served(model, engine_kw, prompt, cache_dir)[0]
    if "recompute" in args.sides:
        row["ttft_recompute_s"] = served(model, engine_kw, prompt, None)[0]
    if "disk" in args.sides:
        files = run_files(cache_dir)
        if args.cold:
            drop_cache(files)
        row["ttft_disk_s"], disk = served(model, engine_kw, prompt, cache_dir)
        if args.cold:
            drop_cache(files)
        raw = read_rate(files)
        row.update(hit_blocks=disk.hit_blocks, bytes_read=disk.bytes_read, load_seconds=disk.load_seconds,
                   achieved_read_gbps=disk.bytes_read / max(disk.load_seconds, 1e-9) / 1e9,
                   disk_sequential_read_gbps=raw / 1e9, files=len(files),
                   disk_usage_bytes=sum(f.stat().st_size for f in files))
    if "ttft_disk_s" in row and "ttft_recompute_s" in row:
        row["disk_over_recompute"] = row["ttft_disk_s"] / row["ttft_recompute_s"]
    return row


def show(row: dict) -> str:
    parts = [f"{row['prompt_len']:>6} tokens:"]
    if "ttft_recompute_s" in row:
        parts.append(f"recompute {row['ttft_recompute_s']:.2f} s")
    if "ttft_recompute_and_write_s" in row:
        parts.append(f"with write-through {row['ttft_recompute_and_write_s']:.2f} s")
    if "ttft_disk_s" in row:
        share = f" = {100 * row['disk_over_recompute']:.1f}%" if "disk_over_recompute" in row else ""
        parts.append(f"from disk {row['ttft_disk_s']:.3f} s{share} ({row['hit_blocks']} blocks, "
                     f"{row['bytes_read'] / 2**20:.0f} MiB in {row['load_seconds']:.3f} s: "
                     f"{row['achieved_read_gbps']:.2f} GB/s; the disk reads {row['disk_sequential_read_gbps']:.2f}"
                     f" GB/s{' cold' if row['cold'] else ''})")
    return " ".join(parts)


def chat(eng: LLMEngine, turns: list[list[int]], answers: list[list[int]] | None, answer_len: int):
    """Run the turns (turns[0]: the first prompt; then each user message appended after the previous answer,
    `answers` when given, else the engine's own): total seconds, summed TTFT, the answers."""
    params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
    context: list[int] = []
    total = first = 0.0
    got_all = []
    for t, user in enumerate(turns):
        context += user
        got: list[int] = []
        t0 = time.perf_counter()
        eng.add_request(f"t{t}-{time.monotonic_ns()}", list(context), params)
        while eng.has_unfinished_requests():
            for o in eng.step():
                for d in o.outputs:
                    if d.token_ids and not got:
                        first += time.perf_counter() - t0
                    got += d.token_ids
        total += time.perf_counter() - t0
        got_all.append(got)
        context += answers[t] if answers else got
    return total, first, got_all


def multi_turn(args, model: str, cache_dir: Path) -> dict:
    rng = random.Random(8)
    first, user, answer, n = args.mt_first, args.mt_user, args.mt_answer, 8
    turns = [[rng.randrange(100, VOCAB) for _ in range(first if t == 0 else user)] for t in range(n)]
    length = first + (n - 1) * user + n * answer
    kw = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=length + 16, max_num_seqs=2)
    model = long_enough(model, length + 16)
    fill = LLMEngine.from_args(model, kv_cache_dir=str(cache_dir), **kw)
    fill_total, fill_first, answers = chat(fill, turns, None, answer)
    fill.close()
    del fill
    runs: dict[str, list[tuple[float, float]]] = {"disk": [], "none": []}
    same = {"disk": True, "none": True}  # the replay's answers are the first run's
    for r in range(args.repeats):
        for side in ("disk", "none") if r % 2 == 0 else ("none", "disk"):
            if side == "disk" and args.cold:
                drop_cache(run_files(cache_dir))
            eng = LLMEngine.from_args(model, **kw, **({"kv_cache_dir": str(cache_dir)} if side == "disk" else {}))
            total, ttft_sum, got = chat(eng, turns, answers, answer)
            same[side] &= got == answers
            runs[side].append((total, ttft_sum))
            eng.close()
            del eng
            gc.collect()
    med = {s: (statistics.median(t for t, _ in v), statistics.median(f for _, f in v)) for s, v in runs.items()}
    return {"turns": n, "first_prompt": first, "user": user, "answer": answer, "final_context": length,
            "fill_total_s": fill_total, "fill_ttft_sum_s": fill_first, "runs": runs,
            "disk_total_s": med["disk"][0], "disk_ttft_sum_s": med["disk"][1], "none_total_s": med["none"][0],
            "none_ttft_sum_s": med["none"][1], "disk_over_none": med["disk"][0] / med["none"][0],
            "same_answers": same, "cold": args.cold}


def batch(eng: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Generated tokens per second of running all `prompts` at once."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"w{i}-{time.monotonic_ns()}", p, params)
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(d.token_ids) for o in eng.step() for d in o.outputs)
    return n / (time.perf_counter() - t0)


def write_cost(args, model: str, cache_dir: Path) -> dict:
    num, inp, out = args.wc_prompts, args.wc_input, args.wc_output
    kw = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=inp + out + 16, max_num_seqs=num)
    share = {} if args.wc_share is None else {"kv_disk_write_share": args.wc_share}
    engines = {"on": LLMEngine.from_args(model, kv_cache_dir=str(cache_dir), **share, **kw),
               "off": LLMEngine.from_args(model, **kw)}

    def prompts(seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, VOCAB) for _ in range(inp)] for _ in range(num)]

    for i, eng in enumerate(engines.values()):  # warm-up
        batch(eng, prompts(-1 - i)[:4], 8)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    seed = 0
    for r in range(args.repeats):
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            seed += 1
            rates[side].append(batch(engines[side], prompts(seed), out))
            if side == "on":
                engines["on"].offload.tier.flush(300)  # its writes finish before the other side runs
    disk = engines["on"].get_stats().disk
    engines["on"].close()
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"prompts": num, "input": inp, "output": out, "rates": rates, "on_tok_s": on, "off_tok_s": off,
            "cost": 1 - on / off, "files_written": disk.files_written, "bytes_written": disk.bytes_written,
            "writes_dropped": disk.writes_dropped, "blocks_skipped": getattr(disk, "writes_skipped", 0),
            "disk_lookups": disk.lookups, "disk_hit_blocks": disk.hit_blocks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--prompt-lens", default="4096")
    p.add_argument("--cold", action="store_true", help="drop the files from the page cache before loading")
    p.add_argument("--dir", default=None, help="where the KV cache directory goes (default: a new temporary one); "
                   "kept, as DIR/kv-LENGTH, when --sides is not all three")
    p.add_argument("--sides", default="write,recompute,disk", help="TTFT: which engines run (A, C, B)")
    p.add_argument("--multi-turn", action="store_true", help="an 8-turn chat replayed after a restart")
    p.add_argument("--mt-first", type=int, default=1024, help="multi-turn: tokens of the first prompt")
    p.add_argument("--mt-user", type=int, default=256, help="multi-turn: tokens of each later user message")
    p.add_argument("--mt-answer", type=int, default=128, help="multi-turn: tokens of each answer")
    p.add_argument("--write-cost", action="store_true", help="batch throughput, disk tier on vs off, no hits")
    p.add_argument("--wc-prompts", type=int, default=64, help="write cost: distinct prompts per batch")
    p.add_argument("--wc-input", type=int, default=256, help="write cost: tokens per prompt")
    p.add_argument("--wc-output", type=int, default=128, help="write cost: tokens generated per prompt")
    p.add_argument("--wc-share", type=float, default=None, help="write cost: --kv-disk-write-share (1: no limit)")
    p.add_argument("--repeats", type=int, default=3, help="multi-turn and write cost: alternated repetitions")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    args.sides = set(args.sides.split(","))
    rows = []
    if args.multi_turn or args.write_cost:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            if args.multi_turn:
                row = multi_turn(args, args.model, Path(d) / "kv")
                print(f"8 turns ({row['first_prompt']} + 7 x {row['user']} prompt tokens, {row['answer']} per answer,"
                      f" {row['final_context']} at the end): first run (filling the disk tier) "
                      f"{row['fill_total_s']:.2f} s; replayed after a restart: with the disk tier "
                      f"{row['disk_total_s']:.2f} s (TTFTs "
                      f"{row['disk_ttft_sum_s']:.2f} s), without {row['none_total_s']:.2f} s (TTFTs "
                      f"{row['none_ttft_sum_s']:.2f} s) = {100 * row['disk_over_none']:.1f}%; medians of "
                      f"{args.repeats}; same answers: {row['same_answers']}", flush=True)
            else:
                row = write_cost(args, args.model, Path(d) / "kv")
                print(f"{row['prompts']} prompts x {row['input']} + {row['output']} tokens: disk tier on "
                      f"{row['on_tok_s']:.1f} tok/s, off {row['off_tok_s']:.1f} tok/s (medians of {args.repeats}): "
                      f"cost {100 * row['cost']:.1f}%; on {[round(x, 1) for x in row['rates']['on']]}, off "
                      f"{[round(x, 1) for x in row['rates']['off']]}; {row['files_written']} files, "
                      f"{row['bytes_written'] / 2**20:.0f} MiB written, {row['writes_dropped']} runs dropped, "
                      f"{row['blocks_skipped']} blocks skipped by the write budget", flush=True)
            rows.append(row)
    else:
        lengths = [int(x) for x in args.prompt_lens.split(",")]
        model = long_enough(args.model, max(lengths) + 16)
        keep = args.sides != {"write", "recompute", "disk"}
        if keep and args.dir is None:
            p.error("--sides other than all three needs --dir (the files are kept there between calls)")
        for length in lengths:
            if keep:
                row = one(args, model, length, Path(args.dir) / f"kv-{length}")
            else:
                with tempfile.TemporaryDirectory(dir=args.dir) as d:
                    row = one(args, model, length, Path(d) / "kv")
            rows.append(row)
            print(show(row), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
