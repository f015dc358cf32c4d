"""Constrained decoding through llguidance: JSON schema, JSON object, regex, choice and Lark / GBNF grammars.

A constraint compiles once into a template matcher (cached, keyed by the constraint's canonical text, and held by
the request's params, so that a request never needs the cache again); every sequence gets a deep copy, which
shares the compiled grammar and advances on the tokens the sequence accepts. PARSER_LIMITS bound what one grammar
may cost (compile, memory, and each row's mask: a grammar past them fails its own request).
Each step the masks of all constrained rows are computed together (llguidance's thread pool, the GIL dropped).
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

from pagedlm.sampling.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256
# Every llguidance limit set here, not left to the library's defaults (in brackets), so that a hostile grammar costs
# bounded work. Per row and step: Earley items (an ambiguous 4-rule grammar reached 0.4-0.8 s per mask on a 49k
# vocabulary under the default; 5,000 keep it near 20-30 ms, and JSON, GBNF and expression grammars stay far below)
# and lexer fuel (~14k/ms). Per grammar: lexer states (1-2 kB each, kept while the grammar is cached) and size.
PARSER_LIMITS = dict(
    max_items_in_row=500,  # [2,000] alternatives alive in one Earley row
    step_max_items=5_000,  # [50,000] Earley items of one mask computation
    step_lexer_fuel=100_000,  # [200,000] lexer work of one mask computation (~7 ms)
    initial_lexer_fuel=1_000_000,  # [1,000,000] building the lexer at compile time (~20 ms)
    max_lexer_states=20_000,  # [250,000] lexer (DFA) states of one grammar: ~40 MB at most, not ~500 MB
    max_grammar_size=200_000,  # [500,000] symbols of the grammar's productions
    precompute_large_lexemes=True,  # [True] large regexes walked over the token trie at compile time
    verbose_errors=False,  # [True] errors name the grammar's rule, not the parser's state (they reach clients)
)
_GBNF = re.compile(r"::=")


class StructuredOutputError(ValueError):
    """The constraint cannot be compiled (bad schema, regex or grammar, or a feature llguidance lacks)."""


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0


def grammar_text(p: StructuredOutputsParams) -> str:
    """llguidance's grammar for the constraint (not yet checked)."""
    json_opts = {"whitespace_flexible": p.whitespace_flexible}
    if p.json is not None:
        return LLMatcher.grammar_from_json_schema(p.json, defaults=json_opts)
    if p.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=json_opts)
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
    lark = p.grammar
    if _GBNF.search(lark):
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(lark)
        except Exception as e:  # GbnfToLarkError, or a bare Exception for an undefined rule: neither a ValueError
            raise ValueError(f"GBNF: {e}") from None
    return LLMatcher.grammar_from_lark(lark)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and fills the batch's token bitmasks.

    vocab_size: the logits' width (the bitmask covers it; ids the tokenizer lacks are never allowed);
    eos_token_ids: all allowed (and only) where the grammar accepts.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, num_threads: int | None = None) -> None:
        eos = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        import llguidance.hf  # imports transformers: not at start-up

        self.tokenizer: LLTokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)), eos_token=eos or None)
        self.words = (self.tokenizer.vocab_size + 31) // 32
        self.executor = LLExecutor(num_threads)
        self.limits = LLParserLimits(**PARSER_LIMITS)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = GrammarStats()

    def compile(self, p: StructuredOutputsParams) -> LLMatcher:
        """The template matcher of `p` (compiled once, then from the cache). Thread-safe.
        Raises StructuredOutputError naming the problem."""
        key = p.cache_key()
        with self._lock:
            m = self._cache.get(key)
            if m is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return m
        try:
            grammar = grammar_text(p)
        except (ValueError, TypeError) as e:
            raise StructuredOutputError(f"Invalid {p.kind} constraint: {e}") from None
        m = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise StructuredOutputError(f"Invalid {p.kind} constraint: {_first_line(m.get_error())}")
        with self._lock:
            self.stats.compiles += 1
            self._cache[key] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def forget(self, p: StructuredOutputsParams) -> None:
        """Drop `p`'s compiled template from the cache (a copy of it stopped at a limit while it ran: its shared
        state may hold that)."""
        with self._lock:
            self._cache.pop(p.cache_key(), None)

    def new_matcher(self, p: StructuredOutputsParams) -> LLMatcher:
        return self.compile(p).deep_copy()

    @staticmethod
    def replay(template: LLMatcher, tokens: list[int]) -> LLMatcher:
        """A fresh copy of `template` (a compiled constraint) advanced over `tokens` (a sequence's output so far)."""
        m = template.deep_copy()
        if tokens and not m.consume_tokens(tokens):
            raise StructuredOutputError(f"The tokens do not follow the constraint: {m.get_error()}")
        return m

    def fill_bitmask(self, matchers: list[LLMatcher], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Int32 bitmasks (bit t of word t // 32: token t allowed), computed in parallel: a row per matcher, and
        with `drafts` (speculative decoding: tokens each matcher's grammar accepts, `drafts[i]` for matcher i) one
        more per draft token, the mask after its sequence and drafts[i][:j] in row j after the matcher's own. The
        matchers end in the state they began in."""
        drafts = drafts or [[]] * len(matchers)
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + 1 + len(d))
        bitmask = torch.full((starts[-1], self.words), -1, dtype=torch.int32)
        plain = [(m, starts[i]) for i, m in enumerate(matchers) if not drafts[i]]
        drafted = [(m, starts[i], drafts[i]) for i, m in enumerate(matchers) if drafts[i]]
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), self.words * 4, starts[-1])
        if drafted:  # each matcher advanced over its drafts and rolled back (llguidance)
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), self.words * 4,
                                                                   starts[-1])
        return bitmask


class PendingMasks:
    """The bitmasks `MaskPrefetcher.start` computes, by key (and draft position); `wait()` once the forward pass is
    done."""

    def __init__(self, index: dict[int, int], future: Future) -> None:
        self.index, self._future, self._bitmask = index, future, None

    def wait(self) -> None:
        if self._bitmask is None:
            self._bitmask = self._future.result()

    def get(self, key: int, position: int = 0) -> torch.Tensor | None:
        """The mask of `key`'s sequence after its first `position` draft tokens."""
        j = self.index.get(key)
        return None if j is None else self._bitmask[j + position]


class MaskPrefetcher:
    """Grammar masks computed on a worker thread (llguidance drops the GIL) while a step's forward pass runs.
    `start` the masks of the step's constrained sequences (the matchers are the worker's until `wait`), `fill`
    the few the step adds later (forks) on the caller's thread. `seconds` is the time spent filling masks.
    `manager()` is the StructuredOutputManager."""

    def __init__(self, manager: Callable[[], StructuredOutputManager]) -> None:
        self.manager = manager
        self.seconds = 0.0
        self._thread: ThreadPoolExecutor | None = None

    def start(self, matchers: dict[int, tuple[LLMatcher, list[int]]]) -> PendingMasks | None:
        """Start the bitmasks of `matchers` (key -> matcher and its sequence's draft tokens, verified in this
        step: a mask per draft position too); None if there are none."""
        if not matchers:
            return None
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagedlm-masks")
        index, row = {}, 0
        for key, (_, drafts) in matchers.items():
            index[key] = row
            row += 1 + len(drafts)
        pairs = list(matchers.values())
        return PendingMasks(index, self._thread.submit(self.fill, [m for m, _ in pairs], [d for _, d in pairs]))

    def fill(self, matchers: list[LLMatcher], drafts: list[list[int]] | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        bitmask = self.manager().fill_bitmask(matchers, drafts)
        self.seconds += time.perf_counter() - t0
        return bitmask


def _first_line(msg: str, limit: int = 500) -> str:
    return (msg.strip().splitlines() or [""])[0][:limit]
