"""Live share calibration: the strong share stays at its target on the traffic actually served.

`ShareCalibrator` keeps the strong scores of the last `window` requests in a sorted list (an exact sliding-window
quantile: O(log n) search, O(n) memmove, microseconds for thousands of scores) and sets the threshold at their
`1 - target` quantile, so that `target` of the recent scores fall at or above it; requests scoring exactly at
the threshold go strong with the probability that makes the share exact (coarse scores, such as the heuristic's,
tie often). A feedback term moves the quantile level by `gain` times the error of the window's realised share,
so a shift in the score distribution is paid back faster than the window turns over. Until `min_samples`
scores are in, the offline threshold (from the training prompts) stands.

Promise (defaults: window 500, gain 4; tested in tests/test_router_live.py): the strong share of the policy's
last 500 decisions stays within +-0.05 of the target, and after an abrupt shift of the score distribution it is
back within that tolerance after at most 500 requests. The feedback trades a little ranking quality for that
(on a stationary synthetic stream, 1-2% of the benefit of an ideal fixed threshold at the same share).

`ShareMonitor` records what was actually served: the realised strong share, the share the quality policy asked
for, and the share the SLA, load, fallback and budget rules moved to the other tier (they keep priority over
the target; the calibrator only sees the policy's own choices).

`psi` is the population stability index of recent scores against the training scores: under 0.1 little
drift, 0.1-0.25 moderate, above 0.25 the classifier sees traffic unlike its training data.
"""
from __future__ import annotations

import bisect
import math
import random
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

FORCING_CATEGORIES = ("sla", "load", "fallback", "budget")


@dataclass(frozen=True)
class CalibrationState:
    target: float
    threshold: float
    samples: int  # scores in the window
    window_share: float | None  # share of the window's decisions the policy sent strong
    psi: float | None  # drift of the window's scores vs the reference (training) scores


class ShareCalibrator:
    """Moves a score threshold so that `target` of recent requests score strong. Thread-safe."""

    def __init__(self, target: float, initial_threshold: float, window: int = 500, min_samples: int = 50,
                 gain: float = 4.0, reference: Sequence[float] | np.ndarray | None = None, seed: int = 0) -> None:
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"the target strong share must be in [0, 1], got {target}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        if gain < 0:
            raise ValueError(f"gain must be >= 0, got {gain}")
        self.target, self.window, self.min_samples, self.gain = target, window, min_samples, gain
        self.initial_threshold = initial_threshold
        self.threshold, self.tie_p = initial_threshold, 1.0
        self.reference = None if reference is None else np.sort(np.asarray(reference, dtype=np.float64))
        self._order: deque[float] = deque()  # arrival order
        self._sorted: list[float] = []
        self._strong: deque[bool] = deque()  # the policy's decision for each score in the window
        self._num_strong = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def decide(self, score: float) -> bool:
        """Whether `score` goes strong at the current threshold (exact ties: strong with probability tie_p)."""
        with self._lock:
            if score != self.threshold:
                return score > self.threshold
            return self._rng.random() < self.tie_p

    def observe(self, score: float, strong: bool) -> None:
        """Add one routed request's score and the policy's decision for it; moves the threshold."""
        if not math.isfinite(score):
            return
        with self._lock:
            self._order.append(score)
            bisect.insort(self._sorted, score)
            self._strong.append(strong)
            self._num_strong += strong
            if len(self._order) > self.window:
                old = self._order.popleft()
                del self._sorted[bisect.bisect_left(self._sorted, old)]
                self._num_strong -= self._strong.popleft()
            if len(self._sorted) >= self.min_samples:
                self._update()
            if self.reference is None and len(self._sorted) == self.window:
                self.reference = np.array(self._sorted)  # no training scores: drift vs the first full window

    def _update(self) -> None:
        xs, n = self._sorted, len(self._sorted)
        realised = self._num_strong / n
        level = min(1.0, max(0.0, self.target + self.gain * (self.target - realised)))
        k = round(level * n)  # scores of the window that should go strong
        if k == 0:
            self.threshold, self.tie_p = math.inf, 0.0
            return
        thr = xs[n - k]
        lo, hi = bisect.bisect_left(xs, thr), bisect.bisect_right(xs, thr)
        above = n - hi
        self.threshold, self.tie_p = thr, (k - above) / (hi - lo)

    def state(self) -> CalibrationState:
        with self._lock:
            n = len(self._sorted)
            scores = np.array(self._sorted) if n else None
            share = self._num_strong / n if n else None
        psi = None if scores is None or self.reference is None else population_stability_index(self.reference, scores)
        return CalibrationState(self.target, self.threshold, n, share, psi)


def population_stability_index(reference: np.ndarray, actual: np.ndarray, bins: int = 10,
                               eps: float = 1e-4) -> float:
    """PSI of `actual` against `reference` on the reference's quantile bins: sum (a - e) ln(a / e)."""
    reference, actual = np.asarray(reference, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    if reference.size == 0 or actual.size == 0:
        return 0.0
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]))
    e = np.bincount(np.searchsorted(edges, reference, side="right"), minlength=edges.size + 1) / reference.size
    a = np.bincount(np.searchsorted(edges, actual, side="right"), minlength=edges.size + 1) / actual.size
    e, a = np.maximum(e, eps), np.maximum(a, eps)
    return float(np.sum((a - e) * np.log(a / e)))


@dataclass(frozen=True)
class ShareStats:
    requests: int  # in the window
    realised: float | None  # share served by a strong model
    policy: float | None  # share the quality policy chose strong (of requests it scored)
    forced: dict[str, dict[str, float]] = field(default_factory=dict)  # rule -> {"strong"|"weak": share moved}


class ShareMonitor:
    """The last `window` served requests: (the policy's tier or None, the tier served, the decision category), and
    with more than two tiers the policy's tier rank and the rank served."""

    def __init__(self, window: int = 500) -> None:
        self._items: deque[tuple[bool | None, bool, str, int | None, int]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record(self, policy_strong: bool | None, strong: bool, category: str, policy_tier: int | None = None,
               tier: int | None = None) -> None:
        with self._lock:
            self._items.append((policy_strong, strong, category, policy_tier, int(strong) if tier is None else tier))

    def stats(self) -> ShareStats:
        with self._lock:
            items = list(self._items)
        n = len(items)
        if not n:
            return ShareStats(0, None, None, {c: {"strong": 0.0, "weak": 0.0} for c in FORCING_CATEGORIES})
        scored = [p for p, *_ in items if p is not None]
        forced = {c: {"strong": 0.0, "weak": 0.0} for c in FORCING_CATEGORIES}
        for p, s, c, *_ in items:
            if c in forced and p is not None and p != s:
                forced[c]["strong" if s else "weak"] += 1.0 / n
        return ShareStats(n, sum(s for _, s, *_ in items) / n, sum(scored) / len(scored) if scored else None, forced)

    def tier_shares(self) -> dict[int, dict[str, float]]:
        """Per tier rank: the share of the window served there ("realised") and the share of the requests the
        policy ranked that it sent there ("policy")."""
        with self._lock:
            items = list(self._items)
        ranked = [pt for *_, pt, _ in items if pt is not None]
        tiers = sorted({t for *_, t in items} | set(ranked))
        return {t: {"realised": sum(r == t for *_, r in items) / len(items),
                    "policy": sum(p == t for p in ranked) / len(ranked) if ranked else 0.0} for t in tiers}
