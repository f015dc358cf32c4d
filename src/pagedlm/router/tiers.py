"""Routing over more than two quality tiers: the cheapest model predicted good enough.

Models sit in tiers 0..T-1, cheapest (weakest) first. A score policy's difficulty score (the heuristic's or the
learned classifier's: higher, harder) is compared with T-1 boundaries; a request goes to the first tier whose upper
boundary it stays below. Boundary j is set so that the share of requests reaching tier j or above is the sum of
the target shares of those tiers: from reference scores (a classifier's training scores) offline, and on live
traffic by one `ShareCalibrator` per boundary, each fed with its own decision, so every tier's share holds as the
two-tier strong share does (same window, feedback and tolerance).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedlm.router.calibration import ShareCalibrator
from pagedlm.router.policies import Candidate, Decision, NoCandidateError, RequestFeatures, ScorePolicy, cheapest


class TieredPolicy:
    """`shares[k]`: the target share of requests for tier k (they sum to 1). `reference`: scores to set the
    offline boundaries from (without it, every boundary starts at the score policy's threshold until live
    calibration has `min_samples` scores)."""

    def __init__(self, scorer: ScorePolicy, shares: Sequence[float], reference: np.ndarray | None = None) -> None:
        shares = [float(s) for s in shares]
        if len(shares) < 2 or min(shares) < 0 or abs(sum(shares) - 1.0) > 1e-6:
            raise ValueError(f"tier shares must be two or more non-negative numbers summing to 1, got {shares}")
        self.scorer, self.shares = scorer, shares
        self.above = [sum(shares[j:]) for j in range(1, len(shares))]  # target share at or above boundary j+1
        start = scorer.threshold
        self.reference = None if reference is None else np.sort(np.asarray(reference, dtype=np.float64))
        self.boundaries = [start if self.reference is None else _quantile(self.reference, a) for a in self.above]
        self.calibrators: list[ShareCalibrator] | None = None

    @property
    def tiers(self) -> int:
        return len(self.shares)

    @property
    def threshold(self) -> float:
        """The first boundary (above it: any tier but the cheapest)."""
        return self.thresholds[0]

    @property
    def thresholds(self) -> list[float]:
        return [c.threshold for c in self.calibrators] if self.calibrators else list(self.boundaries)

    def calibrate_live(self, window: int = 500, min_samples: int = 50, gain: float = 4.0) -> list[ShareCalibrator]:
        self.calibrators = [ShareCalibrator(a, b, window, min_samples, gain, self.reference, seed=j)
                            for j, (a, b) in enumerate(zip(self.above, self.boundaries))]
        return self.calibrators

    def tier_for(self, score: float) -> int:
        """The cheapest tier whose upper boundary `score` stays below (boundaries checked in order)."""
        tier = 0
        for j in range(self.tiers - 1):
            up = self.calibrators[j].decide(score) if self.calibrators else score >= self.boundaries[j]
            if not up:
                break
            tier = j + 1
        return tier

    def observe(self, score: float, tier: int) -> None:
        """Feed one routed request's score and tier to every boundary's live calibration."""
        for j, c in enumerate(self.calibrators or ()):
            c.observe(score, tier > j)

    def choose(self, features: RequestFeatures, candidates: Sequence[Candidate]) -> Decision:
        if not candidates:
            raise NoCandidateError("no candidate models")
        s = self.scorer.score(features)
        want = self.tier_for(s)
        # the wanted tier; if it has no candidate, the nearest, stronger before weaker
        near = sorted({c.tier for c in candidates}, key=lambda t: (abs(t - want), t < want))
        pool = [c for c in candidates if c.tier == near[0]]
        c = cheapest(pool, features)
        note = "" if near[0] == want else f" (no tier-{want} model available)"
        bounds = ", ".join(f"{t:.3f}" for t in self.thresholds)
        return Decision(c.name, f"TieredPolicy: score {s:.3f} against boundaries [{bounds}] -> tier {want}{note}",
                        s, c.stats.replica, "weak" if c.tier == 0 else "strong", want > 0, tier=want)

    def calibrate(self, features: Sequence[RequestFeatures]) -> list[float]:
        """Set the offline boundaries from the scores of `features`."""
        self.reference = np.sort([self.scorer.score(f) for f in features])
        self.boundaries = [_quantile(self.reference, a) for a in self.above]
        return self.boundaries


def _quantile(sorted_scores: np.ndarray, share_above: float) -> float:
    return float("inf") if share_above <= 0 else float(np.quantile(sorted_scores, 1.0 - share_above))



def parse_tier_shares(specs: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """`NAME=SHARE` for every model named in `names`, the shares summing to 1."""
    shares: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if name not in names or not 0.0 <= share <= 1.0 or name in shares:
            raise ValueError(f"--tier-share {spec!r}: expected NAME=SHARE once per model, NAME one of {list(names)} "
                             "and SHARE in [0, 1]")
        shares[name] = share
    if set(shares) != set(names) or abs(sum(shares.values()) - 1.0) > 1e-6:
        raise ValueError(f"--tier-share: every model needs a share and the shares must sum to 1, got {shares}")
    return shares


def tiered_entries(names: Sequence[str], costs: dict[str, tuple[float, float]],
                   shares: dict[str, float]) -> tuple[list, list[float]]:
    """One tier per model, cheapest first (output price, then input price, then the order of `names`): the
    ModelEntry of each (strong: any tier above the cheapest) and the tier shares in tier order."""
    from pagedlm.router.router import ModelEntry

    order = sorted(names, key=lambda n: (costs.get(n, (0.0, 0.0))[1], costs.get(n, (0.0, 0.0))[0], names.index(n)))
    entries = [ModelEntry(n, k > 0, *costs.get(n, (0.0, 0.0)), tier=k) for k, n in enumerate(order)]
    return entries, [shares[n] for n in order]
