"""TTFT of a long prompt whose KV is on disk (--kv-cache-dir), after a restart, against computing it.

For each prompt length: engine A (with the disk tier) prefills a random prompt and writes its blocks (its TTFT:
recompute plus the write-through copy); engine C (no disk tier) prefills it again (TTFT: recompute); engine B, a
new engine on the same directory (a restart), serves it from disk (TTFT: load). `--cold` drops the files from the
page cache first (posix_fadvise DONTNEED, no root needed), so that B reads the disk itself. Also printed: the
disk's own sequential read rate over the same files (cold when --cold) beside the rate the loads achieved.

    .venv/bin/python benchmarks/disk_cache.py --prompt-lens 4096 --cold
    .venv/bin/python benchmarks/disk_cache.py --model path/to/1b.gguf --prompt-lens 4096,16384 --cold
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

from pagedlm.config import DEFAULT_MODEL
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.params import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


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


def one(args, length: int, cache_dir: Path) -> dict:
    rng = random.Random(length)
    engine_kw = dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=length + 16,
                     max_num_seqs=2)  # a pool of two sequences: one cached prefix is revived whole beside the watermark
    vocab = 10_000
    prompt = [rng.randrange(100, vocab) for _ in range(length)]

    a = LLMEngine.from_args(args.model, kv_cache_dir=str(cache_dir), **engine_kw)
    write_ttft = ttft(a, prompt)
    a.close()
    written = a.get_stats()
    del a
    gc.collect()

    c = LLMEngine.from_args(args.model, **engine_kw)
    recompute = ttft(c, prompt)
    del c
    gc.collect()

    files = run_files(cache_dir)
    if args.cold:
        drop_cache(files)
    b = LLMEngine.from_args(args.model, kv_cache_dir=str(cache_dir), **engine_kw)
    load = ttft(b, prompt)
    disk = b.get_stats().disk
    b.close()
    del b
    gc.collect()
    if args.cold:
        drop_cache(files)
    raw = read_rate(files)
    return {"prompt_len": length, "ttft_recompute_s": recompute, "ttft_recompute_and_write_s": write_ttft,
            "ttft_disk_s": load, "disk_over_recompute": load / recompute, "hit_blocks": disk.hit_blocks,
            "bytes_read": disk.bytes_read, "load_seconds": disk.load_seconds,
            "achieved_read_gbps": disk.bytes_read / max(disk.load_seconds, 1e-9) / 1e9,
            "disk_sequential_read_gbps": raw / 1e9, "files": len(files),
            "disk_usage_bytes": sum(f.stat().st_size for f in files), "cold": args.cold,
            "kv_dtype": args.kv_cache_dtype, "prefill_tokens_written_with": written.prompt_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--prompt-lens", default="4096")
    p.add_argument("--cold", action="store_true", help="drop the files from the page cache before loading")
    p.add_argument("--dir", default=None, help="the KV cache directory (default: a new temporary one)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rows = []
    for length in (int(x) for x in args.prompt_lens.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            row = one(args, length, Path(d) / "kv")
        rows.append(row)
        print(f"{length:>6} tokens: recompute {row['ttft_recompute_s']:.2f} s (with write-through "
              f"{row['ttft_recompute_and_write_s']:.2f} s), from disk {row['ttft_disk_s']:.3f} s "
              f"= {100 * row['disk_over_recompute']:.1f}% ({row['hit_blocks']} blocks, "
              f"{row['bytes_read'] / 2**20:.0f} MiB in {row['load_seconds']:.3f} s: "
              f"{row['achieved_read_gbps']:.2f} GB/s; the disk reads {row['disk_sequential_read_gbps']:.2f} GB/s"
              f"{' cold' if args.cold else ''})", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
