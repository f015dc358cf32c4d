"""Single-stream decode of one model under two sets of engine settings, both engines in this process and alternated
round by round (as decode_duel.py alternates pagedlm and llama.cpp): the per-round ratio B / A, then its median. For
settings that change how the same weights are held or run, e.g. huge pages:

    .venv/bin/python benchmarks/decode_ab.py ~/.cache/pagedlm/scale/random-1b-Q4_0.gguf --a '{"huge_pages": false}'

A round's rate is `tokens / (time of a (tokens + 1)-token request - time of a 1-token request)` after the same fresh
`--context`-token prompt, speculation off (one token per read of the weights), as decode_duel.py measures it.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--a", default="{}", help="engine settings of A, as JSON (LLM keyword arguments)")
    ap.add_argument("--b", default="{}", help="engine settings of B, as JSON")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=32)
    args = ap.parse_args()
    from pagedlm import LLM, SamplingParams

    settings = {"A": json.loads(args.a), "B": json.loads(args.b)}
    engines = {k: LLM(model=args.model, **{"speculative_config": None, **v}) for k, v in settings.items()}
    rng = random.Random(0)

    def rate(llm) -> float:
        ids = [rng.randrange(100, 40000) for _ in range(args.context)]
        times = []
        for n in (1, args.tokens + 1):
            t = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
            times.append(time.perf_counter() - t)
        return args.tokens / (times[1] - times[0])

    for llm in engines.values():
        rate(llm)  # first-call costs out of the rounds
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for k, llm in engines.items():
            rates[k].append(rate(llm))
    print(f"{args.model}: {args.rounds} rounds of {args.tokens} tokens")
    for k, v in rates.items():
        print(f"  {k} {json.dumps(settings[k])}: tok/s median {statistics.median(v):6.1f}  "
              f"({' '.join(f'{x:.1f}' for x in v)})")
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    print(f"  B / A per round: median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
