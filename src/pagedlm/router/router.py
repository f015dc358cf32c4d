"""`Router.route(prompt, max_tokens, stats_by_model) -> Decision`: the one call a server makes per request.

Pure CPU and synchronous; the heuristic policy takes microseconds, the learned one a few milliseconds (an async
server may run it in a thread). On a failed call, `fallback` records the error and routes again without the
model; a model that fails `max_failures` times in a row is treated as down for `cooldown_s`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from pagedlm.router.policies import (
    SLO,
    Candidate,
    Decision,
    HeuristicPolicy,
    LeastLoadedPolicy,
    LoadStats,
    NoCandidateError,
    Policy,
    SLAPolicy,
    extract_features,
)


@dataclass(frozen=True)
class ModelEntry:
    """A routable model: its name, quality tier and price per token."""

    name: str
    strong: bool = False
    cost_per_input_token: float = 0.0
    cost_per_output_token: float = 0.0


Stats = LoadStats | Sequence[LoadStats]


class Router:
    def __init__(self, models: Sequence[ModelEntry], policy: Policy | None = None, slo: SLO | None = None,
                 balancer: LeastLoadedPolicy | None = None, max_failures: int = 3, cooldown_s: float = 30.0) -> None:
        if not models:
            raise ValueError("a router needs at least one model")
        self.models = {m.name: m for m in models}
        self.policy: Policy = policy or HeuristicPolicy()
        self.slo = slo
        self.balancer = balancer or LeastLoadedPolicy(slo.max_kv_usage if slo else 0.95)
        self.max_failures, self.cooldown_s = max_failures, cooldown_s
        self._failures: dict[str, int] = {}
        self._down_until: dict[str, float] = {}

    @classmethod
    def learned(cls, path: str | Path, weak: str, strong: str, strong_fraction: float = 0.5,
                threshold: float | None = None, **kwargs) -> "Router":
        """Two-model router on a classifier saved by `pagedlm router train`; its threshold is calibrated for
        `strong_fraction` of the training prompts to go strong, unless `threshold` is given."""
        from pagedlm.router.classifier import WeakCorrectClassifier
        from pagedlm.router.policies import ClassifierPolicy

        policy = ClassifierPolicy(WeakCorrectClassifier.load(path), strong_fraction, threshold)
        return cls([ModelEntry(weak), ModelEntry(strong, strong=True)], policy, **kwargs)

    def route(self, prompt: str, max_tokens: int | None = None, stats_by_model: Mapping[str, Stats] | None = None,
              exclude: Iterable[str] = (), prompt_tokens: int | None = None) -> Decision:
        """Pick a model (and replica) for one request. `stats_by_model`: per model, its LoadStats or one per
        replica (missing: assumed idle). Raises NoCandidateError when no model can take it."""
        features = extract_features(prompt, max_tokens, prompt_tokens)
        stats_by_model = stats_by_model or {}
        excluded, now = set(exclude), time.monotonic()
        candidates = []
        for m in self.models.values():
            if m.name in excluded or self._down_until.get(m.name, 0.0) > now:
                continue
            stats = stats_by_model.get(m.name) or LoadStats()
            replicas = [stats] if isinstance(stats, LoadStats) else list(stats)
            cands = [Candidate(m.name, m.strong, m.cost_per_input_token, m.cost_per_output_token, s) for s in replicas]
            try:
                best = self.balancer.choose(features, cands) if len(cands) > 1 else None
            except NoCandidateError:
                continue
            candidates.append(cands[0] if best is None else next(c for c in cands if c.stats.replica == best.replica))
        if not self.slo:  # with an SLO, SLAPolicy explains what it skips
            candidates = [c for c in candidates if c.stats.healthy]
        if not candidates:
            raise NoCandidateError(f"no model available (excluded: {sorted(excluded)}, "
                                   f"down: {sorted(k for k, t in self._down_until.items() if t > now)})")
        policy = SLAPolicy(self.policy, self.slo) if self.slo else self.policy
        return policy.choose(features, candidates)

    def fallback(self, failed: Decision, prompt: str, max_tokens: int | None = None,
                 stats_by_model: Mapping[str, Stats] | None = None, tried: Iterable[str] = ()) -> Decision:
        """After `failed.model` errored or refused (overload): record it and route to another model."""
        self.report_failure(failed.model)
        d = self.route(prompt, max_tokens, stats_by_model, exclude={failed.model, *tried})
        return replace(d, reason=f"fallback from {failed.model}: {d.reason}", category="fallback")

    def report_failure(self, model: str) -> None:
        self._failures[model] = n = self._failures.get(model, 0) + 1
        if n >= self.max_failures:
            self._down_until[model] = time.monotonic() + self.cooldown_s
            self._failures[model] = 0

    def report_success(self, model: str) -> None:
        self._failures.pop(model, None)
        self._down_until.pop(model, None)
