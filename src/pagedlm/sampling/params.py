"""Per-request sampling parameters, validated before anything is queued."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TEMPERATURE = 2.0  # OpenAI's bound
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: gen_len ** length_penalty stays finite for any max_model_len


@dataclass
class SamplingParams:
    """What to generate and how. Mirrors vLLM's `SamplingParams` where names overlap.

    Seeding: sample `i` of a request with `seed=s` draws from a generator seeded with `s + i`,
    so `n=4, seed=s` yields the same samples as four requests with seeds s, s+1, s+2, s+3.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int | None = None  # defaults to n; the n best finished beams are returned
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never", as in HF transformers

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.use_beam_search and self.beam_width is None:
            self.beam_width = self.n
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raises ValueError unless every field is in its documented range (see README, *Limits and security*):
        extremes that overflow float32 (temperature 1e300, top_p 1e-300, ...) are refused here, not in a step."""
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not (lo < v if lo_open else lo <= v) or v > hi:
                raise bad(name, f"must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")

        def integer(name: str, lo: int, hi: int | None = None) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                raise bad(name, f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))

        integer("n", 1)
        number("temperature", 0.0, MAX_TEMPERATURE)
        number("top_p", 0.0, 1.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (disabled) or a positive integer")
        number("min_p", 0.0, 1.0)
        number("repetition_penalty", *REPETITION_PENALTY_RANGE)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        if self.max_tokens is not None:
            integer("max_tokens", 1)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, 0)
        width = self.beam_width if self.use_beam_search and isinstance(self.beam_width, int) else self.n
        if self.seed is not None:  # sample i draws from seed + i; torch takes seeds in [-2^63, 2^64)
            integer("seed", -2**63, 2**64 - width)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        number("length_penalty", -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        if self.use_beam_search:
            integer("beam_width", 1)
            if self.n > self.beam_width:
                raise bad("n", f"must be <= beam_width ({self.beam_width}) with beam search")
            if self.max_tokens is None:
                raise bad("max_tokens", "must be set with beam search")
            if self.early_stopping not in (True, False, "never"):
                raise bad("early_stopping", "must be True, False or 'never'")
