"""The paged-attention kernel alone (attention/cpu_kernel.py) over KV caches of two dtypes, decode rows, the two
alternated round by round in one process: the median time of a call per shape and the ratio B / A. For choosing a
KV cache dtype per CPU (model/plan.py `default_kv_cache_dtype`):

    .venv/bin/python benchmarks/attention_kv.py --a bfloat16 --b float16

Shapes are (batch, context, query heads, KV heads, head dim): TinyLlama-1.1B's, Gemma 3 270M's, SmolLM2-135M's and
Llama-3.2-3B's heads, single stream deep in a context and batches at short ones. Block tables are shuffled, as a
busy block pool leaves them.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedlm.attention.cpu_kernel import load_kernel, paged_attention_cpu
from pagedlm.attention.metadata import AttentionMetadata

SHAPES = [(1, 4096, 32, 4, 64), (1, 16384, 32, 4, 64), (16, 1024, 32, 4, 64), (64, 256, 32, 4, 64),
          (1, 4096, 4, 1, 256), (64, 256, 4, 1, 256), (1, 2048, 9, 3, 64), (64, 512, 9, 3, 64),
          (1, 4096, 24, 8, 128), (64, 256, 24, 8, 128)]


def decode_batch(batch: int, context: int, block_size: int) -> AttentionMetadata:
    per = -(-context // block_size)
    tables = torch.arange(1, 1 + batch * per, dtype=torch.int32).reshape(batch, per)
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64), block_tables=tables[:, torch.randperm(per)].contiguous(),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens_list=[context] * batch,
        query_lens_list=[1] * batch, max_query_len=1, max_seq_len=context, block_size=block_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="bfloat16")
    ap.add_argument("--b", default="float16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if load_kernel() is None:
        raise SystemExit("the attention kernel did not build (see the log)")
    torch.manual_seed(0)
    dtypes = [getattr(torch, args.a), getattr(torch, args.b)]
    print(f"| batch | context | heads (q / kv) | head dim | {args.a} us | {args.b} us | {args.b} / {args.a} time |")
    print("|---|---|---|---|---|---|---|")
    for batch, context, heads, kv_heads, dim in SHAPES:
        blocks = batch * -(-context // args.block_size) + 1
        k, v = (torch.randn(blocks, args.block_size, kv_heads, dim) for _ in range(2))
        caches = {dt: (k.to(dt), v.to(dt)) for dt in dtypes}
        meta, q = decode_batch(batch, context, args.block_size), torch.randn(batch, heads, dim)
        times: dict[torch.dtype, list[float]] = {dt: [] for dt in dtypes}
        for r in range(args.rounds):
            for dt in (dtypes if r % 2 == 0 else dtypes[::-1]):
                paged_attention_cpu(q, *caches[dt], meta, dim ** -0.5)
                start = time.perf_counter()
                for _ in range(args.calls):
                    paged_attention_cpu(q, *caches[dt], meta, dim ** -0.5)
                times[dt].append((time.perf_counter() - start) / args.calls * 1e6)
        a, b = (statistics.median(times[dt]) for dt in dtypes)
        print(f"| {batch} | {context} | {heads} / {kv_heads} | {dim} | {a:.1f} | {b:.1f} | {b / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()
