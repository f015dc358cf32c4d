"""What block sharing saves, measured on the real model.

  memory: KV blocks in use with sharing (n > 1 samples fork the prompt; beams share their history) against the
          blocks the same sequences would hold without sharing (one private copy of every block each), averaged
          over the engine steps, for parallel sampling n = 2, 4, 6 and beam width 2, 4, 6 (PagedAttention paper,
          section 6.3, reports 6-30% saved for parallel sampling and 38-66% for beam search).
  prefix: 64 requests behind one ~400-token system prompt, prefix caching on vs off: generated tokens/s and
          prompt tokens actually computed.

    .venv/bin/python benchmarks/sharing.py memory --prompts 4 --max-tokens 128
    .venv/bin/python benchmarks/sharing.py prefix --requests 64
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedlm import LLM, SamplingParams
from pagedlm.config import DEFAULT_MODEL

INSTRUCTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works and when to use one.",
    "Give me a recipe for a vegetarian lasagna, with steps.",
    "Describe the water cycle to a ten year old.",
    "List the pros and cons of working from home.",
    "Write a poem about autumn leaves falling in the wind.",
    "Summarize the causes of the first world war.",
    "How do I improve my sleep? Give practical advice.",
]


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    eng = llm.engine
    bm = eng.block_manager
    for i, p in enumerate(prompts):
        eng.add_request(f"m{time.monotonic_ns()}-{i}", p, params)
    shared_used, unshared = [], []
    while eng.has_unfinished_requests():
        eng.step()
        logical = sum(len(bm.get_block_table(s)) for r in eng.scheduler.running for s in r.live_seqs)
        physical = bm.num_total_blocks - bm.num_free_blocks
        if logical:
            shared_used.append(physical)
            unshared.append(logical)
    saved = 1 - sum(shared_used) / sum(unshared)
    return saved, max(shared_used), max(unshared)


def cmd_memory(args) -> None:
    llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
               for t in INSTRUCTIONS[:args.prompts]]
    print(f"{len(prompts)} instruction prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"outputs up to {args.max_tokens} tokens, block size {llm.engine.block_manager.block_size}")
    print(f"{'workload':<22}{'blocks saved (mean over steps)':>32}{'peak blocks shared / unshared':>32}  paper")
    for n in args.n_values:
        params = SamplingParams(n=n, temperature=1.0, top_p=0.95, seed=0, max_tokens=args.max_tokens)
        saved, peak, peak_un = measure(llm, prompts, params)
        print(f"{'parallel sampling n=' + str(n):<22}{saved:>32.1%}{f'{peak} / {peak_un}':>32}  6-30%")
    for k in args.beam_widths:
        params = SamplingParams(use_beam_search=True, beam_width=k, max_tokens=args.max_tokens, early_stopping=False)
        saved, peak, peak_un = measure(llm, prompts, params)
        print(f"{'beam search k=' + str(k):<22}{saved:>32.1%}{f'{peak} / {peak_un}':>32}  38-66%")


def cmd_prefix(args) -> None:
    system = ("You are a meticulous assistant for a logistics company. Follow the policies below. " + " ".join(
        f"Policy {i}: shipments of category {i} must be inspected, labelled, weighed and logged before dispatch, "
        f"and any damage must be reported within {i + 1} days." for i in range(14)))
    rows = []
    for caching in (False, True, False, True):  # alternate; report medians
        llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=caching)
        tok = llm.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": system},
             {"role": "user", "content": f"Question {i}: what about category {i % 14}?"}]),
            add_special_tokens=False) for i in range(args.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        st = llm.engine.get_stats()
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        computed = st.prompt_tokens - st.prefix_cache_hits
        rows.append((caching, gen / elapsed, elapsed, st.prompt_tokens, computed, outs))
    print(f"{args.requests} requests, system prompt of {len(prompts[0]) - 20}+ tokens, "
          f"{args.max_tokens} output tokens each")
    print(f"{'prefix caching':<16}{'gen tok/s (median)':>20}{'wall s (median)':>18}{'prompt tokens':>15}"
          f"{'computed':>10}")
    for caching in (False, True):
        sel = [r for r in rows if r[0] == caching]
        print(f"{'on' if caching else 'off':<16}{statistics.median(r[1] for r in sel):>20.1f}"
              f"{statistics.median(r[2] for r in sel):>18.1f}{sel[0][3]:>15}{sel[0][4]:>10}")
    same = [o.outputs[0].token_ids for o in rows[0][5]] == [o.outputs[0].token_ids for o in rows[1][5]]
    print(f"outputs identical with and without caching: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn in (("memory", cmd_memory), ("prefix", cmd_prefix)):
        p = sub.add_parser(name)
        p.add_argument("--model", default=DEFAULT_MODEL)
        p.add_argument("--dtype", default="auto")
        p.add_argument("--num-kv-blocks", type=int, default=4096)
        p.set_defaults(fn=fn)
        if name == "memory":
            p.add_argument("--prompts", type=int, default=4)
            p.add_argument("--max-tokens", type=int, default=128)
            p.add_argument("--n-values", type=int, nargs="*", default=[2, 4, 6])
            p.add_argument("--beam-widths", type=int, nargs="*", default=[2, 4, 6])
        else:
            p.add_argument("--requests", type=int, default=64)
            p.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
