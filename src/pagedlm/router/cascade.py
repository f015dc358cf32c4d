"""Cascade mode: the weak tier answers first; the answer decides whether the strong tier answers instead."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedlm.router.answer import EscalationScorer, WeakAnswer, answer_features
from pagedlm.router.policies import Candidate, Decision, NoCandidateError, RequestFeatures, ScorePolicy, cheapest


class CascadePolicy(ScorePolicy):
    """Up front, the cheapest weak model takes the request (with `samples` > 1, it draws that many samples of the
    answer, n=k). Once it has answered, the server asks `escalate(answer)`: the `scorer` turns the answer into an
    escalation score (default: minus its mean token logprob; `EscalationScorer.prior()` or a fitted one read the
    per-token logprobs and the samples' agreement), and a request scoring at or above the threshold is re-run on
    the strong tier. The threshold starts at the score of an answer whose every token has logprob `min_logprob`
    (`--cascade-threshold`) and, live-calibrated, follows the target strong share."""

    def __init__(self, min_logprob: float = -1.0, scorer: EscalationScorer | None = None, samples: int = 1) -> None:
        if samples < 1:
            raise ValueError(f"cascade samples must be >= 1, got {samples}")
        self.scorer = scorer or EscalationScorer.mean_logprob()
        self.samples, self.min_logprob = samples, min_logprob
        self.threshold = self.scorer.score(WeakAnswer.of([min_logprob] * 8, ["same"] * samples))

    def choose(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise NoCandidateError("no candidate models")
        weak = [c for c in candidates if not c.strong]
        c = cheapest(weak or candidates, features)
        note = "" if weak else " (no weak model available)"
        return Decision(c.name, f"cascade: {c.name} answers first{note}", None, c.stats.replica,
                        "strong" if c.strong else "weak")

    def escalate(self, answer: WeakAnswer | float) -> tuple[bool, str]:
        """Whether to re-run on the strong tier, and why (feeds the live calibration). A float is read as the
        answer's mean token logprob (an answer of one token)."""
        if not isinstance(answer, WeakAnswer):
            answer = WeakAnswer.of([answer] if math.isfinite(answer) else [-math.inf])
        f = answer_features(answer)
        score = self.scorer.score(answer)
        threshold = self.threshold
        strong = self.wants_strong(score)
        if self.calibrator is not None:
            self.calibrator.observe(score, strong)
        verdict = "re-run on the strong model" if strong else "weak answer kept"
        samples = f", {len(answer.samples)} samples agree {1 - f[-1]:.0%}" if len(answer.samples) > 1 else ""
        return strong, (f"cascade: weak answer's mean token logprob {-f[0]:.3f}, min {-f[1]:.3f}{samples}; "
                        f"{self.scorer.source} score {score:.3f} {'>=' if strong else '<'} {threshold:.3f}: "
                        f"{verdict}")


@dataclass(frozen=True)
class SamplesCost:
    """What drawing k samples of the weak answer (n=k) cost beyond drawing one, from the tokens the weak model
    used: the other k-1 samples' decode tokens. They are forked from the kept sample after the prompt's one
    prefill and read its KV blocks, so they add no prefill; `prefill_reused_tokens` (k-1 x the prompt) is the
    prompt work they did not redo. Costs at the weak model's prices: `extra_cost` (the extra decode tokens) and
    `answer_cost` (the prompt and the kept sample: the one-sample cascade's weak call)."""

    prompt_tokens: int
    sample_tokens: tuple[int, ...]  # decode tokens of each sample, the kept one first
    extra_cost: float = 0.0
    answer_cost: float = 0.0

    @property
    def samples(self) -> int:
        return len(self.sample_tokens)

    @property
    def extra_decode_tokens(self) -> int:
        return sum(self.sample_tokens[1:])

    @property
    def prefill_reused_tokens(self) -> int:
        return max(0, self.samples - 1) * self.prompt_tokens

    def describe(self) -> str:
        share = f" (+{self.extra_cost / self.answer_cost:.0%} of the weak answer's cost)" if self.answer_cost else ""
        return (f"{self.samples - 1} extra samples: {self.extra_decode_tokens} decode tokens, "
                f"{self.prefill_reused_tokens} prompt tokens read from shared KV blocks{share}")


def describe_costs(costs: Sequence[SamplesCost]) -> str:
    """The extra samples' cost per request over many cascaded requests: mean decode tokens added and prompt tokens
    read from shared blocks, against the mean tokens of the one-sample answer (its prompt and kept sample)."""
    n = max(1, len(costs))
    extra = sum(c.extra_decode_tokens for c in costs) / n
    reused = sum(c.prefill_reused_tokens for c in costs) / n
    answer = sum(c.prompt_tokens + (c.sample_tokens[0] if c.sample_tokens else 0) for c in costs) / n
    kept = sum(c.sample_tokens[0] if c.sample_tokens else 0 for c in costs) / n
    k = max((c.samples for c in costs), default=1)
    return (f"extra weak-model cost of {k} samples, per request ({len(costs)} requests): {extra:.2f} decode tokens "
            f"({extra / kept if kept else 0:.2f}x the kept answer's {kept:.2f}), no prefill ({reused:.1f} prompt "
            f"tokens read from shared KV blocks); the one-sample answer is {answer:.1f} tokens (prompt + answer)")
