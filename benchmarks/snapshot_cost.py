"""What a memory-view watcher costs the engine: the engine-thread time of one `build_snapshot` (engine/snapshot.py)
against the decode step it sits between, at batch `--batch` (default 64), and the JSON encoding a server does off
the engine thread. Every step is timed alone; a snapshot is built after each decode step and timed apart.

    .venv/bin/python benchmarks/snapshot_cost.py --batch 64 --max-tokens 32
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedlm.config import DEFAULT_MODEL
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.snapshot import build_snapshot
from pagedlm.sampling.params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="pool size (default: sized by the engine)")
    p.add_argument("--prefix-caching", action="store_true")
    args = p.parse_args()

    engine = LLMEngine.from_args(args.model, num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(args.batch, 1),
                                 enable_prefix_caching=args.prefix_caching)
    for i in range(args.batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    steps, snaps, encodes = [], [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        snap = build_snapshot(engine)
        t2 = time.perf_counter()
        json.dumps(snap.to_dict())
        t3 = time.perf_counter()
        if len(snap.seqs) == args.batch and snap.seqs[0].num_computed_tokens > args.prompt_len:  # decode steps
            steps.append(t1 - t0)
            snaps.append(t2 - t1)
            encodes.append(t3 - t2)
    step, snap_t, enc = (statistics.median(x) * 1000 for x in (steps, snaps, encodes))
    print(json.dumps({"model": args.model, "batch": args.batch, "num_blocks": engine.block_manager.num_total_blocks,
                      "decode_steps": len(steps), "step_ms": round(step, 3), "snapshot_ms": round(snap_t, 3),
                      "snapshot_pct_of_step": round(100 * snap_t / step, 3), "json_encode_ms": round(enc, 3)}))


if __name__ == "__main__":
    main()
