"""What a memory-view watcher costs the engine: the engine-thread time of one `build_snapshot` (engine/snapshot.py)
against the decode step it sits between, at batch `--batch` (default 64), and the JSON encoding a server does off
the engine thread. Every step is timed alone; a snapshot is built after each decode step and timed apart.
`--pool-only N`: no model; the block pool and tables of a bare BlockManager of N blocks, `--batch` sequences
holding most of it, with prefix caching (how the snapshot scales with the pool).

    .venv/bin/python benchmarks/snapshot_cost.py --batch 64 --max-tokens 32
    .venv/bin/python benchmarks/snapshot_cost.py --batch 16 --n 4 --show-text   # forks; blocks' text
    .venv/bin/python benchmarks/snapshot_cost.py --batch 64 --pool-only 100000
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedlm.config import DEFAULT_MODEL
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.engine.snapshot import build_snapshot, pool_snapshot, seq_snapshots
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.sampling.params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="pool size (default: sized by the engine)")
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--n", type=int, default=1, help="samples per request (forked after the prefill)")
    p.add_argument("--show-text", action="store_true", help="with the sequences' and blocks' text")
    p.add_argument("--pool-only", type=int, default=0, metavar="N")
    args = p.parse_args()
    if args.pool_only:
        return pool_only(args.pool_only, args.batch)

    engine = LLMEngine.from_args(args.model, num_kv_blocks=args.num_kv_blocks,
                                 max_num_seqs=max(args.batch * args.n, 1),
                                 enable_prefix_caching=args.prefix_caching)
    for i in range(args.batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(n=args.n, temperature=1.0 if args.n > 1 else 0.0,
                                                           max_tokens=args.max_tokens, ignore_eos=True))
    steps, snaps, encodes = [], [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        snap = build_snapshot(engine, args.show_text)
        t2 = time.perf_counter()
        json.dumps(snap.to_dict())
        t3 = time.perf_counter()
        if len(snap.seqs) == args.batch * args.n and snap.seqs[0].num_computed_tokens > args.prompt_len:  # decode
            steps.append(t1 - t0)
            snaps.append(t2 - t1)
            encodes.append(t3 - t2)
    step, snap_t, enc = (statistics.median(x) * 1000 for x in (steps, snaps, encodes))
    print(json.dumps({"model": args.model, "batch": args.batch, "n": args.n, "show_text": args.show_text,
                      "num_blocks": engine.block_manager.num_total_blocks,
                      "decode_steps": len(steps), "step_ms": round(step, 3), "snapshot_ms": round(snap_t, 3),
                      "snapshot_pct_of_step": round(100 * snap_t / step, 3), "json_encode_ms": round(enc, 3)}))


def pool_only(num_blocks: int, batch: int, block_size: int = 16) -> None:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    per_seq = int(0.9 * num_blocks) // batch * block_size
    reqs = []
    for i in range(batch):
        seq = Sequence([(i * 7919 + j) % 30000 for j in range(per_seq)], status=SequenceStatus.RUNNING)
        bm.allocate(seq, per_seq)
        bm.commit(seq, per_seq)
        seq.num_computed_tokens = per_seq
        reqs.append(("running", Request(f"r{i}", None, seq.prompt_token_ids, SamplingParams(), seqs=[seq])))
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        pool_snapshot(bm.gpu)
        seq_snapshots(reqs, bm)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"num_blocks": num_blocks, "batch": batch, "blocks_in_use": bm.gpu.num_blocks - bm.gpu.num_free,
                      "snapshot_ms": round(statistics.median(times) * 1000, 3)}))


if __name__ == "__main__":
    main()
