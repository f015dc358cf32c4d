"""`Router.route(prompt, max_tokens, stats_by_model) -> Decision`: the one call a server makes per request.

Pure CPU and synchronous; the heuristic policy takes microseconds, the learned one a few milliseconds (an async
server may run it in a thread). On a failed call, `fallback` records the error and routes again without the
model; a model that fails `max_failures` times in a row is treated as down for `cooldown_s`.

With a calibrated policy (`ScorePolicy.calibrate_live`), each routed request's score moves the threshold; with
a `SpendLedger`, a request near a spend cap goes to a cheaper model and one past every cap raises
`BudgetExceededError`. The server reports what it served (`record_served`) and what it cost (`settle`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from pagedlm.dp.placement import LeastLoadedPolicy, LoadStats, NoCandidateError, ReplicaPolicy
from pagedlm.router.answer import WeakAnswer
from pagedlm.router.budget import BudgetExceededError, SpendLedger
from pagedlm.router.calibration import ShareCalibrator, ShareMonitor
from pagedlm.router.cascade import CascadePolicy, SamplesCost
from pagedlm.router.policies import (
    SLO,
    Candidate,
    Decision,
    HeuristicPolicy,
    Policy,
    RequestFeatures,
    SLAPolicy,
    extract_features,
)
from pagedlm.router.tiers import TieredPolicy


@dataclass(frozen=True)
class ModelEntry:
    """A routable model: its name, quality tier and price per token. `tier`: its rank among more than two tiers
    (0: the cheapest; default 1 if strong else 0)."""

    name: str
    strong: bool = False
    cost_per_input_token: float = 0.0
    cost_per_output_token: float = 0.0
    tier: int | None = None

    @property
    def rank(self) -> int:
        return int(self.strong) if self.tier is None else self.tier

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return prompt_tokens * self.cost_per_input_token + completion_tokens * self.cost_per_output_token


Stats = LoadStats | Sequence[LoadStats]


class Router:
    def __init__(self, models: Sequence[ModelEntry], policy: Policy | None = None, slo: SLO | None = None,
                 balancer: ReplicaPolicy | None = None, max_failures: int = 3, cooldown_s: float = 30.0,
                 budget: SpendLedger | None = None, share_window: int = 500) -> None:
        if not models:
            raise ValueError("a router needs at least one model")
        self.models = {m.name: m for m in models}
        self.policy: Policy = policy or HeuristicPolicy()
        self.slo = slo
        self.balancer = balancer or LeastLoadedPolicy(slo.max_kv_usage if slo else 0.95)
        self.max_failures, self.cooldown_s = max_failures, cooldown_s
        self._failures: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self.budget = budget
        self.served = ShareMonitor(share_window)
        self.recent: deque[tuple[float, Decision, float | None]] = deque(maxlen=64)  # (time, served, threshold)

    @property
    def calibrator(self) -> ShareCalibrator | None:
        return getattr(self.policy, "calibrator", None)

    @classmethod
    def learned(cls, path: str | Path, weak: str, strong: str, strong_fraction: float = 0.5,
                threshold: float | None = None, calibration_window: int = 500, **kwargs) -> "Router":
        """Two-model router on a classifier saved by `pagedlm router train`; its threshold starts calibrated for
        `strong_fraction` of the training prompts to go strong and follows live traffic (over the last
        `calibration_window` requests; 0: fixed), unless a fixed `threshold` is given."""
        from pagedlm.router.classifier import WeakCorrectClassifier
        from pagedlm.router.policies import ClassifierPolicy

        clf = WeakCorrectClassifier.load(path)
        policy = ClassifierPolicy(clf, strong_fraction, threshold)
        if threshold is None and calibration_window:
            policy.calibrate_live(strong_fraction, reference=clf.train_scores, window=calibration_window,
                                  min_samples=min(50, calibration_window))
        return cls([ModelEntry(weak), ModelEntry(strong, strong=True)], policy, **kwargs)

    def route(self, prompt: str, max_tokens: int | None = None, stats_by_model: Mapping[str, Stats] | None = None,
              exclude: Iterable[str] = (), prompt_tokens: int | None = None, api_key: str | None = None,
              cost_tokens: tuple[int, int] | None = None, observe: bool = True) -> Decision:
        """Pick a model (and replica) for one request. `stats_by_model`: per model, its LoadStats or one per
        replica (missing: assumed idle). Raises NoCandidateError when no model can take it, BudgetExceededError
        when none fits the spend caps. `cost_tokens`: bounds on the (prompt, completion) tokens the request can
        use, for the budget hold (default: the prompt's UTF-8 bytes + 32, and max_tokens). `observe`: feed the
        score to the live calibration (not for a fallback: the request was already counted)."""
        features = extract_features(prompt, max_tokens, prompt_tokens)
        stats_by_model = stats_by_model or {}
        excluded, now = set(exclude), time.monotonic()
        candidates = []
        for m in self.models.values():
            if m.name in excluded or self._down_until.get(m.name, 0.0) > now:
                continue
            stats = stats_by_model.get(m.name) or LoadStats()
            replicas = [stats] if isinstance(stats, LoadStats) else list(stats)
            cands = [Candidate(m.name, m.strong, m.cost_per_input_token, m.cost_per_output_token, s, m.rank)
                     for s in replicas]
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
        d = policy.choose(features, candidates)
        if self.budget is not None:
            d = self._within_budget(d, features, candidates, api_key, cost_tokens)
        calibrator = self.calibrator
        if observe and isinstance(self.policy, TieredPolicy) and d.score is not None and d.tier is not None:
            self.policy.observe(d.score, d.tier)
        elif observe and calibrator is not None and d.score is not None and d.policy_strong is not None:
            calibrator.observe(d.score, d.policy_strong)
        return d

    def _within_budget(self, d: Decision, features: RequestFeatures, candidates: Sequence[Candidate],
                       api_key: str | None, cost_tokens: tuple[int, int] | None) -> Decision:
        """Keep `d` while its worst-case cost leaves spend under `near` of every cap; past that, the cheapest model
        that still fits; past every cap, BudgetExceededError. Takes a hold on the chosen model's cost."""
        tokens_in, tokens_out = cost_tokens or (len(features.prompt.encode()) + 32, features.max_tokens)
        cost = {c.name: self.models[c.name].cost(tokens_in, tokens_out) for c in candidates}
        chosen = next(c for c in candidates if c.name == d.model)
        status, why = self.budget.check(api_key, cost[chosen.name])
        if status != "ok":
            usable = [c for c in candidates if c.stats.healthy and (
                not self.slo or SLAPolicy(self.policy, self.slo).problem(c, features) is None)]
            cheaper = sorted((c for c in usable if cost[c.name] < cost[chosen.name]),
                             key=lambda c: (cost[c.name], not c.strong, c.name))
            fits = [c for c in cheaper if self.budget.check(api_key, cost[c.name])[0] != "over"]
            if fits:
                c = fits[0]
                d = replace(d, model=c.name, replica=c.stats.replica, category="budget",
                            reason=f"{d.reason}; budget: {why} -> cheaper {c.name} (${cost[c.name]:.4g} at most "
                                   f"vs ${cost[chosen.name]:.4g})")
            elif status == "over":
                cheapest = min(cost.values())
                raise BudgetExceededError(f"the spend cap is reached: {why}",
                                          self.budget.retry_after(api_key, cheapest))
        return replace(d, reservation=self.budget.hold(api_key, cost[d.model]))

    def escalate(self, first: Decision, answer: WeakAnswer | float, prompt: str, max_tokens: int | None = None,
                 stats_by_model: Mapping[str, Stats] | None = None, api_key: str | None = None,
                 cost_tokens: tuple[int, int] | None = None) -> tuple[Decision | None, str]:
        """Cascade mode: after `first` (a weak model) gave this answer (or an answer of this mean token logprob),
        the strong decision to re-run the request with (None: keep the weak answer), and why. Raises like
        `route`."""
        if not isinstance(self.policy, CascadePolicy) or self.models[first.model].strong:
            return None, "not a cascade"
        strong, why = self.policy.escalate(answer)
        if not strong:
            return None, why
        weak = {m.name for m in self.models.values() if not m.strong}
        d = self.route(prompt, max_tokens, stats_by_model, exclude=weak, api_key=api_key, cost_tokens=cost_tokens,
                       observe=False)
        return replace(d, reason=f"{why}; {d.reason}", policy_strong=True), why

    def samples_cost(self, d: Decision, prompt_tokens: int, sample_tokens: Sequence[int]) -> SamplesCost:
        """The extra cost of the k samples `d.model` drew of one cascaded answer (`sample_tokens`: each sample's
        decode tokens, the kept one first), at its prices."""
        m = self.models[d.model]
        return SamplesCost(prompt_tokens, tuple(sample_tokens), m.cost(0, sum(sample_tokens[1:])),
                           m.cost(prompt_tokens, sample_tokens[0] if sample_tokens else 0))

    def record_served(self, d: Decision) -> None:
        """Count a request served as `d` decided (for the realised strong share)."""
        m = self.models[d.model]
        self.recent.append((time.time(), d, getattr(self.policy, "threshold", None)))
        self.served.record(d.policy_strong, m.strong, d.category, d.tier, m.rank)

    def settle(self, d: Decision, prompt_tokens: int, completion_tokens: int) -> None:
        """The request routed by `d` used these tokens: its budget hold becomes their cost."""
        if self.budget is not None:
            self.budget.settle(d.reservation, self.models[d.model].cost(prompt_tokens, completion_tokens))

    def release(self, d: Decision) -> None:
        """The request routed by `d` never ran: drop its budget hold."""
        if self.budget is not None:
            self.budget.release(d.reservation)

    def fallback(self, failed: Decision, prompt: str, max_tokens: int | None = None,
                 stats_by_model: Mapping[str, Stats] | None = None, tried: Iterable[str] = (),
                 api_key: str | None = None, cost_tokens: tuple[int, int] | None = None) -> Decision:
        """After `failed.model` errored or refused (overload): record it and route to another model."""
        self.report_failure(failed.model)
        self.release(failed)
        d = self.route(prompt, max_tokens, stats_by_model, exclude={failed.model, *tried}, api_key=api_key,
                       cost_tokens=cost_tokens, observe=False)
        return replace(d, reason=f"fallback from {failed.model}: {d.reason}", category="fallback",
                       policy_strong=failed.policy_strong, tier=failed.tier)

    def report_failure(self, model: str) -> None:
        self._failures[model] = n = self._failures.get(model, 0) + 1
        if n >= self.max_failures:
            self._down_until[model] = time.monotonic() + self.cooldown_s
            self._failures[model] = 0

    def report_success(self, model: str) -> None:
        self._failures.pop(model, None)
        self._down_until.pop(model, None)
