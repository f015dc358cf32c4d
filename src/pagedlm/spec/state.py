"""One sequence's speculation: its proposer, the drafts it verifies next, its counters and its adaptive draft
length. The rule: each verified draft position is a trial that ends the draft at its first failure, so a sequence's
acceptance rate `alpha` (successes over trials, decayed) estimates P(a draft token is accepted | the previous was);
draft j is then accepted with probability alpha^j, and k is the longest draft whose last token still has a
`MIN_TAIL_ACCEPTANCE` chance per sequence of the step's batch. Below that for the first token, the sequence pauses
for `PAUSE_STEPS` steps, then tries one token again.

Why the bar grows with the batch: a draft row costs the step some time b on top of the time t(B) of a step of B
sequences without drafts, and pays with its chance of being accepted, a token worth t(B) / B. While the step is
bound by reading the weights, t(B) stays about t(1), so the bar b * B / t(B) grows as B: a draft token that pays
with one sequence at a 20% chance needs 40% beside another, 80% among four, and none pays among five. (Measured:
docs/benchmarks.md, "Speculative decoding's adaptive draft length" and "Speculative decoding, batch-aware and
greedy-identical".)"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedlm.spec.proposer import DraftSeq, Proposer

# Measured against other values and a fixed k (benchmarks/spec_adaptive.py, docs/benchmarks.md): none did better.
DECAY = 0.8  # weight of the past in the acceptance estimate, per verified draft position
PRIOR_ALPHA = 0.7
MIN_TAIL_ACCEPTANCE = 0.2
PAUSE_STEPS = 8


@dataclass
class SpecState:
    """`k_max`: the most draft tokens per step; `adaptive`: k follows the acceptance rate (else always k_max);
    `prediction_len`: tokens of a request's prediction (0: drafts from elsewhere)."""

    proposer: Proposer
    k_max: int
    adaptive: bool = True
    prediction_len: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step
    num_drafts: int = 0  # steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    _successes: float = PRIOR_ALPHA
    _trials: float = 1.0
    _paused: int = 0

    @property
    def alpha(self) -> float:
        return self._successes / self._trials

    def next_k(self, batch: int = 1) -> int:
        """How many tokens to draft now, in a step of `batch` sequences (0: not this step)."""
        if not self.adaptive:
            return self.k_max
        bar = MIN_TAIL_ACCEPTANCE * max(1, batch)
        if bar >= 1.0:
            return 0
        if self._paused:
            self._paused -= 1
            return 0 if self._paused else 1
        a = self.alpha
        if a < bar:
            self._paused = PAUSE_STEPS
            return 0
        k = self.k_max if a >= 1.0 else int(math.log(bar) / math.log(a))
        return max(1, min(self.k_max, k))

    def draft_length(self, limit: int, batch: int = 1) -> int:
        """How many tokens to draft now, at most `limit` (the room the sequence has left), in a step of `batch`
        sequences."""
        return min(self.next_k(batch), limit)

    def propose(self, seq: DraftSeq, limit: int, batch: int = 1) -> list[int]:
        """Drafts for the next step, at most `limit` tokens, in a step of `batch` sequences."""
        k = self.draft_length(limit, batch)
        self.draft_token_ids = self.proposer.propose(seq, k) if k > 0 else []
        return self.draft_token_ids

    def record(self, num_draft: int, num_accepted: int) -> None:
        """A draft of `num_draft` tokens was verified; its first `num_accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        trials = num_accepted + (num_accepted < num_draft)
        keep = DECAY ** trials
        self._successes = keep * self._successes + num_accepted
        self._trials = keep * self._trials + trials
