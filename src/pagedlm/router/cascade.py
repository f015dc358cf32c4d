"""Cascade mode: the weak tier answers first; the answer decides whether the strong tier answers instead."""
from __future__ import annotations

import math
from collections.abc import Sequence

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
