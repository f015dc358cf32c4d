"""Cost of constrained decoding: the per-step grammar-mask cost at several batch sizes (the masks of the whole
batch in one call, plus applying them in the sampler), and end-to-end tok/s of JSON-schema generation against
unconstrained generation.

    python -m pagedlm.bench.structured --model smollm2-135m --batch-sizes 1,64 --num-prompts 8 --max-tokens 64
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from pagedlm.bench.common import format_table, median
from pagedlm.config import DEFAULT_MODEL
from pagedlm.sampling.params import SamplingParams, StructuredOutputsParams
from pagedlm.sampling.sampler import Sampler, SamplingRow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "country": {"enum": ["FR", "DE", "US", "UK"]}},
                    "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOC = {"name": "Marie Curie", "age": 66, "email": "marie@example.org", "tags": ["physics", "chemistry"],
       "address": {"city": "Paris", "country": "FR"}}


def mask_cost(engine, batch: int) -> dict:
    """Median seconds per step over the tokens of DOC: filling `batch` masks, then applying them (sampler)."""
    mgr = engine.structured
    so = StructuredOutputsParams(json=SCHEMA)
    tokens = engine.tokenizer.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    matchers = [mgr.new_matcher(so) for _ in range(batch)]
    vocab = engine.model_config.vocab_size
    logits = torch.randn(batch, vocab)
    sampler = Sampler(engine.eos_token_ids)
    params = SamplingParams(temperature=0.0, structured_outputs=so)
    fills, applies = [], []
    for t in tokens:
        t0 = time.perf_counter()
        bitmask = mgr.fill_bitmask(matchers)
        t1 = time.perf_counter()
        sampler(logits, [SamplingRow(params, [0], [], bitmask=bitmask[i]) for i in range(batch)])
        t2 = time.perf_counter()
        plain = [SamplingRow(SamplingParams(temperature=0.0), [0], []) for _ in range(batch)]
        sampler(logits, plain)
        t3 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append((t2 - t1) - (t3 - t2))
        for m in matchers:
            assert m.consume_token(t), m.get_error()
    return {"batch": batch, "steps": len(tokens), "fill_ms": median(fills) * 1e3, "apply_ms": median(applies) * 1e3,
            "total_ms": (median(fills) + median(applies)) * 1e3}


def throughput(llm, num_prompts: int, max_tokens: int, constrained: bool) -> dict:
    prompts = [[{"role": "user", "content": f"Give a JSON profile of person number {i}: name, age, email, tags and "
                                            "address (city, country)."}] for i in range(num_prompts)]
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    llm.engine.mask_seconds_total = 0.0
    t0 = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = sum(_parses(o.outputs[0].text) for o in outs)
    return {"mode": "json_schema" if constrained else "unconstrained", "tokens": n, "seconds": dt,
            "tok_per_s": n / dt, "mask_s": llm.engine.mask_seconds_total, "valid_json": f"{valid}/{len(outs)}"}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    from pagedlm import LLM

    llm = LLM(model=args.model, dtype=args.dtype)
    rows = [mask_cost(llm.engine, int(b)) for b in args.batch_sizes.split(",")]
    print(format_table(rows, [("batch", "batch", "d"), ("steps", "steps", "d"), ("fill_ms", "fill ms/step", ".3f"),
                              ("apply_ms", "apply ms/step", ".3f"), ("total_ms", "total ms/step", ".3f")]))
    runs = [throughput(llm, args.num_prompts, args.max_tokens, c) for c in (False, True, False, True)][2:]
    print(format_table(runs, [("mode", "mode", "s"), ("tokens", "tokens", "d"), ("seconds", "s", ".2f"),
                              ("tok_per_s", "tok/s", ".1f"), ("mask_s", "mask s", ".3f"),
                              ("valid_json", "valid JSON", "s")]))


if __name__ == "__main__":
    main()
