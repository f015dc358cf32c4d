"""Per-request sampling parameters, validated before anything is queued."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pagedlm.sampling.thinking import ReasoningTags

MAX_TEMPERATURE = 2.0  # OpenAI's bound
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: gen_len ** length_penalty stays finite for any max_model_len
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias
MAX_LOGIT_BIAS_ENTRIES = 1024  # a hostile client cannot make every step add a vocab-sized bias
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_GRAMMAR_CHARS = 100_000  # JSON schema (serialized), regex, grammar, or all choices together
MAX_CHOICES = 1024
MAX_PREDICTION_CHARS = 400_000  # a predicted output (the file being edited), as text ...
MAX_PREDICTION_TOKENS = 100_000  # ... or as token ids
MAX_JSON_DEPTH = 128  # nesting of JSON text inside a request (the request body's own parser allows as much)


class JSONDepthError(ValueError):
    """JSON text inside a request is nested more than MAX_JSON_DEPTH levels deep."""


def within_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """No list or dict in `value` lies more than `limit` levels deep (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return False
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


def loads_json(text: str, name: str) -> Any:
    """`json.loads` for JSON text inside a request: ValueError naming `name` if it is not JSON or is nested more
    than MAX_JSON_DEPTH levels deep (JSONDepthError; never a RecursionError)."""
    too_deep = JSONDepthError(f"{name} is nested more than {MAX_JSON_DEPTH} levels deep.")
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep from None
    except ValueError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not within_depth(value):
        raise too_deep
    return value


@dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's `StructuredOutputsParams`): exactly one of `json` (a JSON schema, as
    a dict or its JSON text), `json_object` (any JSON object), `regex`, `choice` (one of these strings) or
    `grammar` (Lark, or GBNF/EBNF as llama.cpp writes it)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool = False  # JSON may hold whitespace between tokens (OpenAI's outputs are compact)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return self._given()[0]

    def _given(self) -> list[str]:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        return [k for k in kinds if getattr(self, k) not in (None, False)]

    def validate(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}.")
        if isinstance(self.json, str):
            self.json = loads_json(self.json, "structured_outputs.json")
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object.")
        if self.json is not None and not within_depth(self.json):
            raise ValueError(f"structured_outputs.json is nested more than {MAX_JSON_DEPTH} levels deep.")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or len(self.choice) > MAX_CHOICES \
                    or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty "
                                 "strings.")
        if len(self.cache_key()) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs is longer than {MAX_GRAMMAR_CHARS} characters.")

    def cache_key(self) -> str:
        """A canonical text of the constraint: equal constraints (dict key order aside) have equal keys."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.whitespace_flexible], sort_keys=True, separators=(",", ":"))


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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (each as a whole token sequence)
    structured_outputs: StructuredOutputsParams | None = None
    prediction: str | list[int] | None = None  # OpenAI's Predicted Outputs: the expected output (draft tokens)
    thinking_token_budget: int | None = None  # reasoning tokens before `</think>` is forced (sampling/thinking.py)
    reasoning_tags: ReasoningTags | None = None  # the reasoning parser's tags: needed with thinking_token_budget
    # set by the engine: the tags as token ids
    _thinking_start_ids: list[int] = field(default_factory=list, repr=False)
    _thinking_end_ids: list[int] = field(default_factory=list, repr=False)
    # set by the engine: the prediction as token ids
    _prediction_token_ids: list[int] = field(default_factory=list, repr=False)
    # set by the engine: bad_words as token sequences (each with and without a leading space, as vLLM does)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # set by the sampler on first use (sampler.allowed_mask): allowed_token_ids as a [vocab] bool tensor
    _allowed_mask: Any = field(default=None, repr=False, compare=False)
    # set by prepare_params: the compiled constraint (an llguidance matcher every sequence copies), held for the
    # request's life so that the engine thread never compiles; not pickled (another process compiles its own)
    _grammar: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_grammar": None}

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.use_beam_search and self.beam_width is None:
            self.beam_width = self.n
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raises ValueError unless every field is in its documented range (see docs/python-api.md, *SamplingParams*):
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
            integer("max_tokens", 0)
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
            for name in ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "prediction"):
                if getattr(self, name):
                    raise ValueError(f"{name} is not supported with beam search.")
        if self.thinking_token_budget is not None:
            integer("thinking_token_budget", 0)
            if self.use_beam_search:
                raise ValueError("thinking_token_budget is not supported with beam search.")
            if not isinstance(self.reasoning_tags, ReasoningTags):
                raise ValueError("thinking_token_budget needs reasoning_tags (the server's reasoning parser).")
        self._validate_token_controls()

    def _validate_token_controls(self) -> None:
        def token_id(t: object) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and t >= 0

        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ValueError(f"logit_bias holds {len(self.logit_bias)} entries; at most "
                                 f"{MAX_LOGIT_BIAS_ENTRIES} are allowed.")
            for t, v in self.logit_bias.items():
                if not token_id(t):
                    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {t!r}.")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                        or abs(v) > MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                     f"{MAX_LOGIT_BIAS:g}], got {v!r} for token {t}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(not token_id(t) for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids.")
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words holds {len(self.bad_words)} entries; at most {MAX_BAD_WORDS} "
                                 "are allowed.")
            if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                raise ValueError(f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} "
                                 "characters.")
        if self.prediction is not None:
            p = self.prediction
            if isinstance(p, str):
                if len(p) > MAX_PREDICTION_CHARS:
                    raise ValueError(f"prediction holds {len(p)} characters; at most {MAX_PREDICTION_CHARS} are "
                                     "allowed.")
            elif not isinstance(p, list) or len(p) > MAX_PREDICTION_TOKENS or not all(token_id(t) for t in p):
                raise ValueError(f"prediction must be a string or a list of at most {MAX_PREDICTION_TOKENS} token "
                                 "ids.")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams.")
            self.structured_outputs.validate()

    @property
    def needs_logits_processing(self) -> bool:
        """Token controls or a constraint change the distribution (so the plain greedy argmax is not enough)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self._bad_words_token_ids
                    or self.structured_outputs is not None)
