"""The cascade's escalation score: how little a weak model's answer deserves trust, read from the answer itself.

The mean token logprob alone is biased by length (a long answer averages its few unsure tokens away) and blind to
the one token that decides an answer. `answer_features` reads more of the answer: its per-token logprobs' mean,
minimum and low quantiles, the logprob sum normalised by the square root of the length, the share of unsure tokens
(probability under one half), the length itself, and, when the weak model drew k samples of the answer (`n=k`,
sharing the prompt's KV blocks), how much they disagree. `EscalationScorer` combines them into one score (higher:
escalate): a linear model over standardised features, either the built-in prior or weights fit by logistic
regression on answers labelled right or wrong (`pagedlm router train-cascade`). The cascade compares the score
with a threshold calibrated live to the target strong share, as before.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ANSWER_FEATURES = ("neg_mean", "neg_min", "neg_q10", "neg_q25", "neg_median", "neg_sum_per_sqrt_len",
                   "unsure_share", "log_len", "disagreement")
UNSURE_LOGPROB = math.log(0.5)
_FLOOR = -30.0  # logprobs below this (and -inf) count as this: one impossible token must not swamp the scale
_WORDS = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class WeakAnswer:
    """What the weak model answered: the kept answer's token logprobs and, with k samples, every sample's text
    (the kept answer's first)."""

    token_logprobs: tuple[float, ...]
    samples: tuple[str, ...] = ()

    @classmethod
    def of(cls, token_logprobs: Sequence[float], samples: Sequence[str] = ()) -> "WeakAnswer":
        return cls(tuple(float(v) for v in token_logprobs), tuple(samples))


def normalise(text: str, limit: int = 64) -> str:
    """The part of an answer that samples are compared on: lower-case words, the first `limit` characters."""
    return " ".join(_WORDS.findall(text.lower()))[:limit]


def agreement(samples: Sequence[str]) -> float:
    """Share of the samples that give the most common (normalised) answer; 1.0 for fewer than two samples."""
    if len(samples) < 2:
        return 1.0
    return Counter(normalise(s) for s in samples).most_common(1)[0][1] / len(samples)


def answer_features(answer: WeakAnswer) -> np.ndarray:
    """The ANSWER_FEATURES of one answer (an empty answer reads as fully confident, of length 0)."""
    lp = np.maximum(np.nan_to_num(np.asarray(answer.token_logprobs, dtype=np.float64), nan=_FLOOR,
                                  neginf=_FLOOR, posinf=0.0), _FLOOR)
    n = lp.size
    lp = np.minimum(lp, 0.0) if n else np.zeros(1)
    q10, q25, q50 = np.quantile(lp, [0.1, 0.25, 0.5])
    return np.array([-lp.mean(), -lp.min(), -q10, -q25, -q50, -lp.sum() / math.sqrt(max(n, 1)),
                     float((lp < UNSURE_LOGPROB).mean()) if n else 0.0, math.log1p(n),
                     1.0 - agreement(answer.samples)])


# The prior: each feature over a typical spread, weighted by how directly it says "unsure"; the length alone is
# no evidence either way. Disagreement among samples weighs most: samples that differ are a wrong answer's mark.
_PRIOR_SCALE = np.array([1.0, 6.0, 3.0, 1.5, 0.5, 3.0, 0.3, 1.0, 0.3])
_PRIOR_WEIGHT = np.array([1.0, 0.5, 1.0, 0.5, 0.25, 0.5, 0.5, 0.0, 3.0])


class EscalationScorer:
    """score(answer) = weights . (features - shift) / scale + bias; higher: escalate to the strong tier."""

    def __init__(self, weights: np.ndarray, shift: np.ndarray, scale: np.ndarray, bias: float = 0.0,
                 source: str = "prior") -> None:
        self.weights, self.shift, self.scale = (np.asarray(a, dtype=np.float64) for a in (weights, shift, scale))
        if not (self.weights.shape == self.shift.shape == self.scale.shape == (len(ANSWER_FEATURES),)):
            raise ValueError(f"an escalation scorer has {len(ANSWER_FEATURES)} weights, shifts and scales")
        if not np.all(self.scale > 0) or not np.all(np.isfinite(self.weights)):
            raise ValueError("scales must be > 0 and weights finite")
        self.bias, self.source = float(bias), source

    @classmethod
    def prior(cls) -> "EscalationScorer":
        return cls(_PRIOR_WEIGHT, np.zeros(len(ANSWER_FEATURES)), _PRIOR_SCALE)

    @classmethod
    def mean_logprob(cls) -> "EscalationScorer":
        """Minus the mean token logprob alone (the cascade's original signal)."""
        w = np.zeros(len(ANSWER_FEATURES))
        w[0] = 1.0
        return cls(w, np.zeros(len(ANSWER_FEATURES)), np.ones(len(ANSWER_FEATURES)), source="mean")

    def score(self, answer: WeakAnswer) -> float:
        return self.score_features(answer_features(answer)[None, :])[0]

    def score_features(self, x: np.ndarray) -> np.ndarray:
        return ((np.asarray(x, dtype=np.float64) - self.shift) / self.scale) @ self.weights + self.bias

    @classmethod
    def fit(cls, x: np.ndarray, weak_correct: np.ndarray, l2: float = 1e-2, steps: int = 500) -> "EscalationScorer":
        """Logistic regression of "the weak answer is wrong" on standardised features `x` [n, ANSWER_FEATURES]
        (Newton's method; a constant feature gets weight 0). The score is the fitted log-odds of wrong."""
        x = np.asarray(x, dtype=np.float64)
        y = 1.0 - np.asarray(weak_correct, dtype=np.float64)
        if x.ndim != 2 or x.shape != (len(y), len(ANSWER_FEATURES)) or y.min() == y.max():
            raise ValueError(f"need [n, {len(ANSWER_FEATURES)}] answer features and answers both right and wrong")
        shift, spread = x.mean(0), x.std(0)
        scale = np.where(spread > 1e-9, spread, 1.0)
        z = np.hstack([(x - shift) / scale, np.ones((len(x), 1))])
        beta = np.zeros(z.shape[1])
        reg = np.full(z.shape[1], l2 * len(x))
        reg[-1] = 0.0
        for _ in range(steps):
            p = 1.0 / (1.0 + np.exp(-(z @ beta)))
            grad = z.T @ (p - y) + reg * beta
            hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(reg + 1e-9)
            step = np.linalg.solve(hess, grad)
            beta -= step
            if np.abs(step).max() < 1e-8:
                break
        beta[:-1][spread <= 1e-9] = 0.0
        return cls(beta[:-1], shift, scale, beta[-1], source="fit")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": "pagedlm-cascade-v1", "features": list(ANSWER_FEATURES),
                                          "weights": self.weights.tolist(), "shift": self.shift.tolist(),
                                          "scale": self.scale.tolist(), "bias": self.bias}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "EscalationScorer":
        blob = json.loads(Path(path).read_text())
        if blob.get("format") != "pagedlm-cascade-v1" or blob.get("features") != list(ANSWER_FEATURES):
            raise ValueError(f"{path}: not a pagedlm cascade scorer (or one for other answer features)")
        return cls(blob["weights"], blob["shift"], blob["scale"], blob["bias"], source=str(path))
