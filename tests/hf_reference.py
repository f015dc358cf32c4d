"""HF transformers as the reference: greedy continuations step by step, and the check against them."""
from __future__ import annotations

import inspect

import torch


def _cache_of(out):
    """The KV cache a forward returned: `cache` in transformers 5, `past_key_values` before."""
    return out["cache"] if "cache" in out else out.past_key_values


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy continuation of each prompt with HF's own modeling code and KV cache: (tokens, log-softmax per step)."""
    results = []
    with torch.inference_mode():
        # transformers 5 takes the cache as `cache` (`past_key_values` is deprecated there), 4.x as `past_key_values`
        cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            past, tokens, logprobs = _cache_of(out), [], []
            logits = out.logits[0, -1]
            for _ in range(new_tokens):
                lp = torch.log_softmax(logits.float(), -1)
                tok = int(lp.argmax())
                tokens.append(tok)
                logprobs.append(lp)
                out = model(torch.tensor([[tok]]), use_cache=True, **{cache_arg: past})
                past, logits = _cache_of(out), out.logits[0, -1]
            results.append((tokens, logprobs))
    return results


def assert_matches_hf(outputs, reference, tol: float = 1e-3) -> None:
    """Token ids identical and HF's top-5 logprobs at every step within `tol` of ours."""
    for out, (hf_tokens, hf_logprobs) in zip(outputs, reference, strict=True):
        comp = out.outputs[0]
        assert comp.token_ids == hf_tokens
        for step, (ours, ref) in enumerate(zip(comp.logprobs, hf_logprobs)):
            top5 = torch.topk(ref, 5)
            for lp, tid in zip(top5.values.tolist(), top5.indices.tolist()):
                assert tid in ours, f"step {step}: HF top-5 token {tid} missing from ours"
                assert abs(ours[tid].logprob - lp) < tol, (step, tid, ours[tid].logprob, lp)
