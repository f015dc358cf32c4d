"""Decode speed of a mixture-of-experts model: routed (top-k experts per token) against the same model run
densely (every expert for every token) and against HF transformers, at batch 1 and 64.

The model is a random-weight Mixtral at SmolLM2-135M's proportions (hidden 576, 9 heads / 3 KV heads, vocab 49152)
with 8 experts of one SmolLM2 MLP each (intermediate 1536), top-2, `--layers` layers. Decode tok/s is
batch x (n - 1) / (time for n new tokens - time for 1), so prefill is left out; runs alternate, medians reported.

    .venv/bin/python benchmarks/moe.py --layers 4 --new-tokens 32 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def save_tokenizer(path: Path) -> None:
    """A one-token-per-id tokenizer (the benchmark feeds token ids): WordLevel over 49152 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(49152)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="t0", unk_token="t1").save_pretrained(path)


class Pagedlm:
    def __init__(self, path: Path, dense: bool, quantization: str | None) -> None:
        from pagedlm import LLM

        self.name = ("pagedlm dense (all experts)" if dense else "pagedlm routed") + (
            f" {quantization}" if quantization else "")
        self.llm = LLM(str(path), dtype="float32", num_kv_blocks=2048, quantization=quantization)
        if dense:
            for _, moe in self.llm.engine.runner.moe_blocks:
                moe.top_k = moe.num_experts

    def generate(self, prompts: list[list[int]], n: int) -> None:
        from pagedlm import SamplingParams

        self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)


class HF:
    name = "HF transformers"

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], n: int) -> None:
        with torch.inference_mode():
            self.model.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                pad_token_id=0)


def decode_rate(backend, prompts: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    backend.generate(prompts, 1)
    t1 = time.perf_counter()
    backend.generate(prompts, n)
    t2 = time.perf_counter()
    return len(prompts) * (n - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default=None, help="also run pagedlm routed with int8 / int4 weights")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_model(path, args.layers, args.experts, args.top_k)
        backends = [Pagedlm(path, dense=False, quantization=None), Pagedlm(path, dense=True, quantization=None)]
        if args.quantization:
            backends.append(Pagedlm(path, dense=False, quantization=args.quantization))
        if not args.no_hf:
            backends.append(HF(path))
        gen = torch.Generator().manual_seed(0)
        print(f"Mixtral-style MoE: {args.layers} layers, {args.experts} experts of 576x1536, top-{args.top_k}, "
              f"fp32, {torch.get_num_threads()} threads; decode tok/s, median of {args.repeats}")
        print(f"{'backend':32s} {'batch':>5s} {'decode tok/s':>13s} {'vs routed':>10s}")
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = torch.randint(2, 49152, (batch, args.prompt_len), generator=gen).tolist()
            for b in backends:
                b.generate(prompts[:2], 2)  # warm-up
            rates: dict[str, list[float]] = {b.name: [] for b in backends}
            for _ in range(args.repeats):
                for b in backends:
                    rates[b.name].append(decode_rate(b, prompts, args.new_tokens))
            base = statistics.median(rates[backends[0].name])
            for b in backends:
                m = statistics.median(rates[b.name])
                print(f"{b.name:32s} {batch:5d} {m:13.1f} {m / base:9.2f}x")


def build_model(path: Path, layers: int, experts: int, top_k: int) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_local_experts=experts,
                        num_experts_per_tok=top_k, max_position_embeddings=2048, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.1)  # routing that varies from token to token
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)


if __name__ == "__main__":
    main()
