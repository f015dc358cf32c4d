"""Speculative decoding's configuration: vLLM's `--speculative-config` JSON shape, checked once at start-up."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "suffix", "draft_model")
UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """How sequences speculate (docs/speculative.md). `method` ngram: drafts come from the longest n-gram
    (prompt_lookup_min..prompt_lookup_max tokens) that ends the sequence and occurred earlier in it (vLLM's prompt
    lookup); `suffix`: the same, then over the outputs of the last `suffix_decoding_max_cached_requests` requests
    (spec/suffix.py); `draft_model`: a smaller `model` with the target's tokenizer drafts greedily, in the engine's
    process with a paged KV cache of its own (spec/draft_model.py), its weights quantized by `quantization` (None: as
    the engine would run that checkpoint); `draft_tensor_parallel_size` is vLLM's and can only be 1 here.
    `num_speculative_tokens`: the most draft tokens a sequence verifies in one step; with
    `adaptive`, each sequence's k follows its recent acceptance rate. Speculation pauses while more than
    `disable_by_batch_size` sequences run (the step is no longer bound by reading the weights). `sampled`: sampled
    requests speculate too, verified by rejection sampling (their tokens keep the model's distribution, but a seeded
    request's tokens then depend on its drafts, so on the requests beside it); else only greedy ones, whose tokens
    speculation does not change.

    The default (`DEFAULT`, the flag's `auto`): greedy requests draft by prompt lookup; `off` (or None): no request
    speculates but those with a `prediction`."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive: bool = True
    disable_by_batch_size: int = 4
    suffix_decoding_max_cached_requests: int = 64
    model: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int | None = None
    sampled: bool = True

    def __post_init__(self) -> None:
        if self.method in UNSUPPORTED_METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported yet; "
                             f"supported: {list(SPEC_METHODS)}.")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(SPEC_METHODS)}, got {self.method!r}.")
        for name, lo, hi in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                             ("prompt_lookup_min", 1, MAX_LOOKUP), ("prompt_lookup_max", 1, MAX_LOOKUP),
                             ("disable_by_batch_size", 1, None), ("suffix_decoding_max_cached_requests", 0, 4096)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                raise ValueError(f"speculative_config: {name} must be an integer in [{lo}, {hi or 'inf'}], got {v!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max}).")
        if self.method == "draft_model":
            from pagedlm.config.engine import QUANTIZATION_METHODS  # engine.py imports this module

            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError("speculative_config: method 'draft_model' needs model (a model name, .gguf file or "
                                 "HF directory).")
            if self.quantization not in (None, *QUANTIZATION_METHODS):
                raise ValueError(f"speculative_config: quantization must be one of {list(QUANTIZATION_METHODS)} "
                                 f"or null, got {self.quantization!r}.")
            tp = self.draft_tensor_parallel_size
            if tp not in (None, 1) or isinstance(tp, bool):
                raise ValueError("speculative_config: draft_tensor_parallel_size must be 1 (the draft model runs in "
                                 f"the engine's process), got {self.draft_tensor_parallel_size!r}.")
        else:
            for name in ("model", "quantization", "draft_tensor_parallel_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config: {name} is only for method 'draft_model' "
                                     f"(method is {self.method!r}).")
        for name in ("adaptive", "sampled"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"speculative_config: {name} must be true or false, got {getattr(self, name)!r}.")

    def describe(self) -> str:
        """The start-up line."""
        source = {"ngram": "prompt lookup", "suffix": "suffix drafts", "draft_model": f"draft model {self.model}"}
        who = "every request" if self.sampled else "greedy requests"
        return (f"speculative decoding: {source[self.method]} for {who}, up to {self.num_speculative_tokens} tokens a "
                f"step, paused above {self.disable_by_batch_size} sequences")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From the flag's JSON text, `auto` (DEFAULT), `off`, a dict (`LLM(speculative_config={...})`) or a
        config; None stays None. Raises ValueError naming the bad key or value."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and value.strip() in ("auto", "off"):
            return DEFAULT if value.strip() == "auto" else None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e.msg} at character {e.pos}).") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}.")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens.")
        if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value = {**value, "prompt_lookup_min": min(cls.prompt_lookup_min, value["prompt_lookup_max"])
                     if isinstance(value["prompt_lookup_max"], int) else value["prompt_lookup_max"]}
        return cls(**value)


# Measured (docs/benchmarks.md, "Speculation on by default"): prompt lookup for greedy requests cost at most 3% on
# every benchmark with drafting paused above 3 sequences (at 4, open chat lost 3% on a Zen 4), and gave 2.9-3.2x
# single stream where answers repeat their prompt or themselves.
DEFAULT = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=3, sampled=False)


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The --speculative-config flag's value (JSON text); a bad one is the flag's error."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
