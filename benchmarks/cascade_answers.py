"""Labelled weak answers for the cascade's escalation scorer: a model answers arithmetic it can check.

Each prompt is a few-shot sum or product of small numbers; the model draws `--samples` answers at once (n=k,
temperature 0.7, `--max-tokens` tokens, the chosen tokens' logprobs) and the first is right when its first integer
is the result. Writes one `{"token_logprobs", "samples", "weak_correct", "prompt_tokens", "sample_tokens"}` line
per prompt, the input of `pagedlm router train-cascade` (which reports how well the mean logprob, the prior and a
fitted scorer separate the wrong answers from the right ones, and what the extra samples cost). The k samples fork
the prompt's KV blocks: each adds a decode of at most `--max-tokens` tokens, no prefill; their cost is computed per
request from the tokens each sample generated (`router.cascade.SamplesCost`) and printed.

    .venv/bin/python benchmarks/cascade_answers.py --prompts 800 --samples 4 --out answers.jsonl
    .venv/bin/pagedlm router train-cascade answers.jsonl --out cascade.json
"""
from __future__ import annotations

import argparse
import json
import re

import numpy as np

from pagedlm import LLM, SamplingParams
from pagedlm.config import DEFAULT_MODEL
from pagedlm.router.cascade import SamplesCost, describe_costs

SHOTS = "Q: 2 + 3 = ?\nA: 5\nQ: 10 + 4 = ?\nA: 14\nQ: 3 * 2 = ?\nA: 6\nQ: 7 + 1 = ?\nA: 8\n"


def questions(n: int, seed: int) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        op = str(rng.choice(["+", "*"]))
        hi = int(rng.choice([5, 10, 20, 50]))
        a, b = int(rng.integers(1, hi)), int(rng.integers(1, hi if op == "+" else 6))
        out.append((f"{SHOTS}Q: {a} {op} {b} = ?\nA:", a + b if op == "+" else a * b))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", type=int, default=800)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    items = questions(args.prompts, args.seed)
    # seeds apart per prompt (sample j of prompt i: seed + i*k + j): one seed for every prompt would give each
    # prompt's sample j the same noise, correlating the answers across prompts
    params = [SamplingParams(n=args.samples, temperature=0.7, max_tokens=args.max_tokens, logprobs=0,
                             seed=args.seed * 1_000_003 + i * args.samples) for i in range(len(items))]
    outputs = LLM(model=args.model).generate([q for q, _ in items], params, use_tqdm=False)
    right, costs = 0, []
    with open(args.out, "w") as f:
        for (_, result), out in zip(items, outputs):
            samples = sorted(out.outputs, key=lambda c: c.index)
            first = samples[0]
            lps = [pos[tok].logprob for pos, tok in zip(first.logprobs, first.token_ids)]
            m = re.search(r"-?\d+", first.text)
            ok = bool(m and int(m.group()) == result)
            right += ok
            costs.append(SamplesCost(len(out.prompt_token_ids), tuple(len(c.token_ids) for c in samples)))
            f.write(json.dumps({"token_logprobs": lps, "samples": [c.text.split("\n")[0] for c in samples],
                                "weak_correct": ok, "prompt_tokens": costs[-1].prompt_tokens,
                                "sample_tokens": list(costs[-1].sample_tokens)}) + "\n")
    print(f"{args.prompts} answers of {args.model}, {right / args.prompts:.1%} right; wrote {args.out}")
    print(describe_costs(costs))


if __name__ == "__main__":
    main()
