"""Offline throughput of `LLM.generate` against HF transformers' static batching, plus KV utilization.

64 chat requests with prompts of 20-300 tokens and max_tokens of 16-128 (many stop earlier at EOS), the same
requests and dtype for both, run in one invocation (alternating, repeated; medians reported).

KV utilization = token slots holding real tokens / slots allocated, sampled every engine step, against what a
contiguous per-request reservation would hold for the same running set (prompt + max_tokens, and max_model_len).

    .venv/bin/python benchmarks/engine_vs_hf.py --repeats 2
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pagedlm.config import DEFAULT_MODEL

WORDS = ("memory block cache page table sequence token attention model engine request batch schedule kernel "
         "latency throughput prefix share copy write swap host device layer head vector matrix").split()


def make_workload(tok, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        target = rng.randint(20, 300)
        words = []
        while True:
            text = f"Question {i}: explain in a few sentences: " + " ".join(words)
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
            if len(ids) >= target:
                break
            words.extend(rng.choice(WORDS) for _ in range(8))
        reqs.append((ids, rng.randint(16, 128)))
    return reqs


def run_pagedlm(llm, reqs) -> dict:
    from pagedlm import SamplingParams

    eng = llm.engine
    for i, (ids, max_tokens) in enumerate(reqs):
        eng.add_request(f"b{time.monotonic_ns()}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    util, phys_util, reserve_util, reserve_max_util = [], [], [], []
    generated = 0
    bs = eng.block_manager.block_size
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                generated += sum(len(o.token_ids) for o in out.outputs)
        real = reserved = reserved_max = logical = 0
        for req in eng.scheduler.running:
            for s in req.live_seqs:
                real += s.num_computed_tokens
                logical += len(eng.block_manager.get_block_table(s)) * bs
                reserved += len(req.prompt_token_ids) + req.params.max_tokens
                reserved_max += eng.max_model_len
        used_slots = (eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks) * bs
        if used_slots:
            util.append(real / logical)
            phys_util.append(real / used_slots)
            reserve_util.append(real / reserved)
            reserve_max_util.append(real / reserved_max)
    elapsed = time.perf_counter() - start
    return dict(seconds=elapsed, generated=generated, tok_s=generated / elapsed,
                kv_util_paged=statistics.mean(util), kv_util_physical=statistics.mean(phys_util),
                kv_util_reserve_max_tokens=statistics.mean(reserve_util),
                kv_util_reserve_max_model_len=statistics.mean(reserve_max_util))


def run_hf(model, tok, reqs, eos_id: int, batch_size: int) -> dict:
    """Static batching: left-padded batches run until every member is done or the batch's max_tokens."""
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else eos_id
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(reqs), batch_size):
            batch = reqs[b:b + batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max(m for _, m in batch), eos_token_id=eos_id, pad_token_id=pad)
            for row, (_, max_tokens) in zip(out[:, width:].tolist(), batch):
                row = row[:max_tokens]
                generated += row.index(eos_id) + 1 if eos_id in row else len(row)
    elapsed = time.perf_counter() - start
    return dict(seconds=elapsed, generated=generated, tok_s=generated / elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-hf", action="store_true", help="only pagedlm (for the KV utilization figures)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from pagedlm import LLM
    from pagedlm.config import parse_dtype

    dtype = parse_dtype(args.dtype)
    llm = LLM(args.model, dtype=dtype)
    tok = llm.get_tokenizer()
    path = llm.engine.model_path
    if args.no_hf:
        hf = None
    elif path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=dtype).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    reqs = make_workload(tok, args.num_requests, args.seed)
    eos = min(llm.engine.eos_token_ids)
    lens = [len(ids) for ids, _ in reqs]
    print(f"{len(reqs)} requests, prompt tokens {min(lens)}-{max(lens)} (mean {statistics.mean(lens):.0f}), "
          f"max_tokens 16-128, dtype {dtype}, torch threads {torch.get_num_threads()}")

    results = {"pagedlm": [], "hf": []}
    for r in range(args.repeats):  # alternate so both see the same machine conditions
        results["pagedlm"].append(run_pagedlm(llm, reqs))
        if not args.no_hf:
            results["hf"].append(run_hf(hf, tok, reqs, eos, args.hf_batch_size))
        print(f"  repeat {r}: " + ", ".join(f"{k} {v[-1]['tok_s']:.1f} tok/s" for k, v in results.items() if v))
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in results.items() if v}
    p = results["pagedlm"][-1]
    print(f"\n{'backend':<10}{'generated tok/s (median)':>26}{'generated tokens':>18}")
    for k, v in results.items():
        if v:
            print(f"{k:<10}{med[k]:>26.1f}{v[-1]['generated']:>18}")
    if "hf" in med:
        print(f"ratio pagedlm / hf: {med['pagedlm'] / med['hf']:.2f}x")
    print("\nKV utilization (slots holding real tokens / slots allocated, mean over steps)")
    print(f"  paged blocks (block_size {llm.engine.block_manager.block_size}): {p['kv_util_paged']:.1%}")
    print(f"  physical blocks, shared prefix blocks counted once: {p['kv_util_physical']:.1%} "
          "(above 100% when requests share cached prefix blocks)")
    print(f"  contiguous reservation of prompt + max_tokens: {p['kv_util_reserve_max_tokens']:.1%}")
    print(f"  contiguous reservation of max_model_len ({llm.engine.max_model_len}): "
          f"{p['kv_util_reserve_max_model_len']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_tok_s": med, "runs": results}, f, indent=2)


if __name__ == "__main__":
    main()
