"""Request and sequence state. A request (vLLM's sequence group) owns one sequence per sample."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedlm.engine.protocol import CompletionDelta
from pagedlm.outputs import PositionLogprobs, RequestMetrics
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.thinking import ThinkingScan
from pagedlm.spec.state import SpecState

if TYPE_CHECKING:
    from pagedlm.engine.pooling import PoolingState


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                SequenceStatus.FINISHED_ABORTED: "abort"}.get(self)


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream. `num_computed_tokens` of its tokens have K/V in the cache. What its request's outputs have
    not carried yet: the tokens from `num_sent_tokens` on, `unsent_text` (the new text, and text held back that
    could still become a stop string) and `unsent_logprobs`; `finish_sent` once its end was sent. A sequence forked
    from another (a sample of n > 1, a beam chosen twice) records it: `parent_seq_id`, and `forked_at`, the tokens
    they shared then."""

    prompt_token_ids: list[int]
    index: int = 0  # sample index within its request
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    detokenizer: object | None = None
    cache_salt: str | None = None
    matcher: object | None = None  # llguidance.LLMatcher of a constrained request, advanced on accepted tokens
    num_sent_tokens: int = 0
    unsent_text: str = ""
    unsent_logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_sent: bool = False
    spec: SpecState | None = None  # a speculating sequence's proposer, drafts and acceptance (spec/state.py)
    parent_seq_id: int | None = None  # the sequence it was forked from (None: its request's first)
    forked_at: int = 0  # tokens (prompt and output) it shared with its parent when forked
    thinking: ThinkingScan | None = None  # a thinking budget's scan of its output (sampling/thinking.py)

    @property
    def draft_token_ids(self) -> list[int]:
        """Tokens proposed to follow this sequence, verified in its next step (speculative decoding)."""
        return self.spec.draft_token_ids if self.spec is not None else []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING


@dataclass(eq=False)
class Request:
    """A prompt and its sampling parameters; starts with one sequence and forks to `n` after prefill."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    cache_salt: str | None = None
    num_cached_tokens: int = 0
    beam: object | None = None  # sampling.beam_search.BeamSearch for beam-search requests
    beam_outputs: list[CompletionDelta] | None = None  # the n best hypotheses, once the search is done
    output_started: bool = False  # its first output (with the prompt) was made
    pooler: PoolingState | None = None  # an embedding request's vector, pooled as its prompt is computed

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)

    def keep_seqs(self, kept: list[Sequence]) -> None:
        """Keep only the sequences `kept` (a beam step's). One whose parent is dropped is re-hung from its nearest
        kept ancestor (the tokens it shares with that one: the fewest along the way), so every recorded parent
        stays among `seqs`."""
        ids = {s.seq_id for s in kept}
        dropped = {s.seq_id: s for s in self.seqs if s.seq_id not in ids}
        for seq in kept:
            while seq.parent_seq_id in dropped:
                parent = dropped[seq.parent_seq_id]
                seq.parent_seq_id, seq.forked_at = parent.parent_seq_id, min(seq.forked_at, parent.forked_at)
        self.seqs = kept

    @property
    def num_seqs_reserved(self) -> int:
        """Sequences this request may run at once: `n` (or beam_width) until it has forked, so that admitting
        it never lets the batch (and the logits of one step) grow past max_num_seqs."""
        if self.beam is not None:
            return max(self.params.beam_width, len(self.live_seqs))
        return len(self.live_seqs) if self.forked else self.params.n

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def reads_every_position(self) -> bool:
        """Every prompt position's output is read (prompt logprobs, mean pooling): a cached prefix, whose
        positions are not computed, is not reused."""
        return self.wants_prompt_logprobs or (self.pooler is not None and self.pooler.every_position)
