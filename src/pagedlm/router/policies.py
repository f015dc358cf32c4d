"""Routing policies. Each is a small class with `choose(features, candidates) -> Decision`.

Quality policies (heuristic, learned classifier, random) score a request and send it to a strong candidate when
the score reaches their threshold, else to the cheapest weak one; `calibrate` sets the threshold so that a target
share of requests goes strong (RouteLLM's calibration), `calibrate_live` keeps moving it so that the share holds on
live traffic. `CascadePolicy` (cascade.py) sends every request to the weak tier first and judges the answer
afterwards.
`TieredPolicy` (tiers.py) spreads requests over more than two tiers.
`SLAPolicy` wraps a quality policy and skips candidates that are down, overloaded, over budget or predicted to
miss the latency objective. Among replicas of one model, a replica placement policy (`dp/placement.py`) picks one.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from pagedlm.dp.placement import LoadStats, NoCandidateError
from pagedlm.router.calibration import ShareCalibrator

if TYPE_CHECKING:
    from pagedlm.router.classifier import WeakCorrectClassifier


@dataclass(frozen=True)
class Decision:
    model: str
    reason: str
    score: float | None = None  # the quality policy's strong score, where it has one
    replica: str | None = None
    category: str = ""  # short, bounded label of `reason`: weak | strong | sla | load | fallback | budget
    policy_strong: bool | None = None  # the quality policy's own tier choice, before SLA/load/budget rules
    reservation: int | None = None  # the budget's hold on this request's cost (settled with the tokens used)
    tier: int | None = None  # with more than two tiers: the quality policy's tier choice (0: the cheapest)


@dataclass
class Candidate:
    """A model (or one replica of it) a request may go to. `strong` is its quality tier; `tier` its rank among
    more than two (default: 1 if strong else 0)."""

    name: str
    strong: bool = False
    cost_per_input_token: float = 0.0
    cost_per_output_token: float = 0.0
    stats: LoadStats = field(default_factory=LoadStats)
    tier: int | None = None

    def __post_init__(self) -> None:
        if self.tier is None:
            self.tier = int(self.strong)

    def cost(self, f: "RequestFeatures") -> float:
        return f.prompt_tokens * self.cost_per_input_token + f.max_tokens * self.cost_per_output_token


@dataclass(frozen=True)
class RequestFeatures:
    """What the policies read of one request. The prompt's markers (question type, code, math, choice lines) are
    read on first use and kept: their regexes are most of a decision's feature time, and the learned policy never
    reads them."""

    prompt: str
    prompt_tokens: int  # estimated (~4 characters a token) unless given
    max_tokens: int

    @cached_property
    def has_code(self) -> bool:
        return bool(_CODE.search(self.prompt))

    @cached_property
    def has_math(self) -> bool:
        return bool(_MATH.search(self.prompt))

    @cached_property
    def choices(self) -> int:
        """Multiple-choice lines (`A.`, `B)` ...)."""
        return count_choices(self.prompt)

    @cached_property
    def question_type(self) -> str:
        """"code" | "math" | "reasoning" | "multiple_choice" | "factual" | "open"."""
        if self.has_code:
            return "code"
        if self.has_math:
            return "math"
        if _REASONING.search(self.prompt):
            return "reasoning"
        if self.choices >= 2:
            return "multiple_choice"
        return "factual" if _FACTUAL.search(self.prompt) else "open"


_CODE = re.compile(r"```|\bdef |\bclass |\breturn\b|#include|\bfunction\b|=>|;\s*$|\bimport |\bSELECT\b|</?\w+>"
                   r"|\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|regex|compile|debug|stack trace)\b",
                   re.IGNORECASE | re.MULTILINE)
_MATH = re.compile(r"\d\s*[-+*/^=<>]\s*\d|\\frac|\\sum|\\int|\$[^$]+\$|\b(integral|derivative|equation|solve|prove|"
                   r"theorem|probability|matrix|polynomial|modulo|log|sqrt|factorial|eigen)\w*", re.IGNORECASE)
_REASONING = re.compile(r"\b(why|explain|prove|derive|analy[sz]e|compare|step by step|evaluate|justify|design|"
                        r"optimi[sz]e|trade-?offs?|implications?)\b", re.IGNORECASE)
_FACTUAL = re.compile(r"^\s*(what|who|when|where|which|name|define)\b", re.IGNORECASE)
_CHOICES = re.compile(r"^[^\S\n]*[A-D][.)]\s", re.MULTILINE)  # blanks within the line only: linear


def count_choices(prompt: str) -> int:
    """Lines that start (after blanks) with a multiple-choice label: `A.`, `B)` ... `D.` and a blank."""
    return len(_CHOICES.findall(prompt))


def extract_features(prompt: str, max_tokens: int | None = None, prompt_tokens: int | None = None) -> RequestFeatures:
    return RequestFeatures(prompt, prompt_tokens if prompt_tokens is not None else max(1, len(prompt) // 4),
                           max_tokens or 256)


class Policy(Protocol):
    def choose(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> Decision: ...


def cheapest(cands: Sequence[Candidate], f: RequestFeatures) -> Candidate:
    return min(cands, key=lambda c: (c.cost(f), c.cost_per_output_token, c.name))


class ScorePolicy:
    """Strong candidate iff `score(features) >= threshold`; subclasses define `score` (higher: needs strong).
    With a `calibrator` (live calibration), the calibrator's moving threshold decides instead."""

    _threshold: float = 0.5
    calibrator: ShareCalibrator | None = None

    @property
    def threshold(self) -> float:
        return self.calibrator.threshold if self.calibrator is not None else self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._threshold = value

    def wants_strong(self, score: float) -> bool:
        return self.calibrator.decide(score) if self.calibrator is not None else score >= self._threshold

    def calibrate_live(self, strong_fraction: float, reference: np.ndarray | None = None,
                       **kwargs) -> ShareCalibrator:
        """Keep `strong_fraction` of live traffic strong, starting from the current threshold (see
        `ShareCalibrator` for `window`, `min_samples`, `gain`); `reference`: training scores, for drift."""
        self.calibrator = ShareCalibrator(strong_fraction, self._threshold, reference=reference, **kwargs)
        return self.calibrator

    def score(self, features: RequestFeatures) -> float:
        raise NotImplementedError

    def choose(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise NoCandidateError("no candidate models")
        s = self.score(features)
        strong = [c for c in candidates if c.strong]
        weak = [c for c in candidates if not c.strong]
        threshold = self.threshold
        want_strong = self.wants_strong(s)
        pool = (strong or weak) if want_strong else (weak or strong)
        tier = "strong" if want_strong else "weak"
        note = "" if pool is (strong if want_strong else weak) else f" (no {tier} model available)"
        c = cheapest(pool, features)
        return Decision(c.name, f"{type(self).__name__}: score {s:.3f} {'>=' if want_strong else '<'} "
                                f"threshold {threshold:.3f} -> {tier}{note}", s, c.stats.replica,
                        "strong" if c.strong else "weak", want_strong)

    def calibrate(self, features: Sequence[RequestFeatures], strong_fraction: float) -> float:
        """Set the threshold so that about `strong_fraction` of `features` score at or above it."""
        self.threshold = threshold_for(np.array([self.score(f) for f in features]), strong_fraction)
        return self.threshold


def threshold_for(scores: np.ndarray, strong_fraction: float) -> float:
    """The `1 - strong_fraction` quantile of `scores` (+inf for 0: nothing goes strong)."""
    if not 0.0 <= strong_fraction <= 1.0:
        raise ValueError(f"strong_fraction must be in [0, 1], got {strong_fraction}")
    return float("inf") if strong_fraction == 0.0 else float(np.quantile(scores, 1.0 - strong_fraction))


class HeuristicPolicy(ScorePolicy):
    """Complexity in [0, 1] from the prompt length, the requested max_tokens and, for a free-form request, its
    question type and code/math markers. A multiple-choice question is judged by its length alone: on MMLU the
    markers ranked questions below their length (docs/routing.md; math looks hard, the strong model misses it too)."""

    TYPE_WEIGHT = {"code": 0.3, "math": 0.3, "reasoning": 0.2, "multiple_choice": 0.1, "open": 0.1, "factual": 0.0}

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = threshold

    def score(self, f: RequestFeatures) -> float:
        length = min(1.0, math.log1p(f.prompt_tokens) / math.log1p(2048))
        answer = min(1.0, math.log1p(f.max_tokens) / math.log1p(4096))
        if f.choices >= 2:  # characters break ties between equal token counts
            return 0.35 * length + 0.15 * answer + self.TYPE_WEIGHT["multiple_choice"] + 1e-9 * len(f.prompt)
        s = 0.35 * length + 0.15 * answer + self.TYPE_WEIGHT[f.question_type]
        s += 0.1 * (f.has_code and f.question_type != "code") + 0.1 * (f.has_math and f.question_type != "math")
        return min(1.0, s)


class ClassifierPolicy(ScorePolicy):
    """Score = 1 - P(weak model answers correctly), from the learned classifier; the threshold is calibrated on
    its training prompts for `strong_fraction` unless given."""

    def __init__(self, classifier: "WeakCorrectClassifier", strong_fraction: float = 0.5,
                 threshold: float | None = None) -> None:
        self.classifier = classifier
        self.threshold = classifier.threshold_for(strong_fraction) if threshold is None else threshold

    def score(self, f: RequestFeatures) -> float:
        return float(self.classifier.score_texts([f.prompt])[0])


class RandomPolicy(ScorePolicy):
    """Baseline: strong with probability `strong_fraction`."""

    def __init__(self, strong_fraction: float = 0.5, seed: int | None = 0) -> None:
        self.rng = random.Random(seed)
        self.threshold = 1.0 - strong_fraction

    def score(self, f: RequestFeatures) -> float:
        return self.rng.random()


@dataclass
class SLO:
    """Per-request objectives; None means unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    max_cost: float | None = None
    max_kv_usage: float = 0.95  # at or above: overloaded
    max_queue: int | None = None  # at or above: overloaded


class SLAPolicy:
    """Take `preferred`'s choice unless that model is down, overloaded, over budget or predicted to miss the SLO;
    then the next candidate that passes (same tier first, then the nearest tiers, stronger first; cheapest first).
    If none passes, the healthy non-overloaded candidate with the lowest predicted TTFT. Predicted TTFT: the recent
    TTFT times (1 + queue_len / concurrency); predicted TPOT: the recent TPOT."""

    def __init__(self, preferred: Policy, slo: SLO, concurrency: float = 1.0) -> None:
        self.preferred, self.slo, self.concurrency = preferred, slo, concurrency

    def predict_ttft(self, c: Candidate) -> float:
        return (c.stats.ttft_s or 0.0) * (1.0 + c.stats.queue_len / self.concurrency)

    def problem(self, c: Candidate, f: RequestFeatures) -> str | None:
        """Why `c` should not take the request, or None."""
        st, slo = c.stats, self.slo
        if not st.healthy:
            return "down"
        if st.kv_usage >= slo.max_kv_usage or (slo.max_queue is not None and st.queue_len >= slo.max_queue):
            return f"overloaded (kv {st.kv_usage:.0%}, queue {st.queue_len})"
        if slo.max_cost is not None and c.cost(f) > slo.max_cost:
            return f"cost {c.cost(f):.4g} > {slo.max_cost:.4g}"
        if slo.ttft_s is not None and (t := self.predict_ttft(c)) > slo.ttft_s:
            return f"predicted TTFT {t:.3f}s > {slo.ttft_s:.3f}s"
        if slo.tpot_s is not None and st.tpot_s is not None and st.tpot_s > slo.tpot_s:
            return f"TPOT {st.tpot_s:.3f}s > {slo.tpot_s:.3f}s"
        return None

    def choose(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise NoCandidateError("no candidate models")
        first = self.preferred.choose(features, candidates)
        pref = next(c for c in candidates if c.name == first.model)
        others = sorted((c for c in candidates if c is not pref),
                        key=lambda c: (abs(c.tier - pref.tier), c.tier < pref.tier, c.cost(features), c.name))
        skipped, category = [], first.category
        for c in [pref, *others]:
            why = self.problem(c, features)
            if why is None:
                reason = first.reason if c is pref else f"{first.reason}; skipped {'; '.join(skipped)}"
                return replace(first, model=c.name, reason=reason, replica=c.stats.replica, category=category)
            if c is pref:
                category = "load" if why.startswith(("down", "overloaded")) else "sla"
            skipped.append(f"{c.name}: {why}")
        usable = [c for c in candidates if c.stats.healthy and c.stats.kv_usage < self.slo.max_kv_usage]
        if not usable:
            raise NoCandidateError(f"every model is down or overloaded: {'; '.join(skipped)}")
        c = min(usable, key=lambda c: (self.predict_ttft(c), c.cost(features)))
        return replace(first, model=c.name, reason=f"no model meets the SLO ({'; '.join(skipped)}); lowest predicted "
                       "TTFT", replica=c.stats.replica, category="sla")
