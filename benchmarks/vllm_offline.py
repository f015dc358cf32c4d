"""The vLLM-CPU peer's side of `pagedlm bench throughput`: the same workload (random token-id prompts of equal
length, greedy, EOS ignored, new prompts every repetition), run with vLLM's offline `LLM.generate`. Run it with the
peer's interpreter (shared/peers/setup-vllm-cpu.sh installs it; its wrapper sets the thread binding and allocator):

    ~/.cache/peers/vllm-cpu/bin/python benchmarks/vllm_offline.py --num-prompts 64 --input-len 128 --output-len 128

It prints one line per repetition and the median output tok/s. Kept free of pagedlm imports: vLLM's venv does not
have pagedlm.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=(Path.home() / ".cache/peers/vllm-cpu/model-path").read_text().strip()
                    if (Path.home() / ".cache/peers/vllm-cpu/model-path").exists() else None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)

    def prompts() -> list:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(100, args.vocab_size) for _ in range(args.input_len)])
                for _ in range(args.num_prompts)]

    llm.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates = []
    for r in range(args.repeats):
        batch = prompts()
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(n / dt)
        print(f"vllm repeat {r}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s", flush=True)
    print(f"vllm batch {args.num_prompts} x ({args.input_len} -> {args.output_len}): median "
          f"{statistics.median(rates):.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
