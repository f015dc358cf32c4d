"""More than two tiers: per-tier boundaries calibrated to per-tier shares, the nearest tier when one is missing, the
SLA rules across tiers, the serve flags, and a three-tier server whose shares hold within 5 points."""
from __future__ import annotations

import numpy as np
import pytest

from pagedlm.router import SLO, HeuristicPolicy, LoadStats, ModelEntry, Router, ScorePolicy, extract_features
from pagedlm.router.tiers import TieredPolicy, parse_tier_shares, tiered_entries

SHARES = [0.5, 0.3, 0.2]
TIERS = [ModelEntry("small", False, 1e-7, 2e-7, tier=0), ModelEntry("mid", True, 1e-6, 2e-6, tier=1),
         ModelEntry("big", True, 1e-5, 3e-5, tier=2)]


class StreamScore(ScorePolicy):
    """Scores from a list, one per request."""

    def __init__(self, scores) -> None:
        self.scores, self.threshold = iter(scores), 0.5

    def score(self, f) -> float:
        return float(next(self.scores))


def test_live_boundaries_hold_every_tier_share_and_order_by_difficulty():
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.normal(0, 1, 1500), rng.normal(2, 0.5, 1500)])  # a shift halfway
    policy = TieredPolicy(StreamScore(scores), SHARES)
    policy.calibrate_live(window=500, min_samples=50)
    router = Router(TIERS, policy)
    served = [router.route(f"request {i}", 16) for i in range(len(scores))]
    tiers = np.array([d.tier for d in served])
    for end in (1500, 2000, 3000):  # before, one window after and long after the shift
        window = tiers[end - 500:end]
        assert max(abs((window == k).mean() - s) for k, s in enumerate(SHARES)) < 0.05, end
    assert [d.model for d in served[-3:]] == [TIERS[t].name for t in tiers[-3:]]
    late = scores[2000:]
    means = [late[tiers[2000:] == k].mean() for k in range(3)]
    assert means[0] < means[1] < means[2]  # harder requests go to pricier tiers


def test_offline_boundaries_from_reference_scores():
    ref = np.linspace(0, 1, 1001)
    policy = TieredPolicy(HeuristicPolicy(), SHARES, reference=ref)
    assert policy.thresholds == pytest.approx([0.5, 0.8])
    assert [policy.tier_for(s) for s in (0.1, 0.49, 0.5, 0.79, 0.8, 0.99)] == [0, 0, 1, 1, 2, 2]
    assert TieredPolicy(HeuristicPolicy(), [0.7, 0.3, 0.0], reference=ref).tier_for(10.0) == 1  # an empty top tier
    for bad in ([1.0], [0.5, 0.6], [0.5, -0.1, 0.6]):
        with pytest.raises(ValueError):
            TieredPolicy(HeuristicPolicy(), bad)


def test_missing_tier_goes_to_the_nearest_stronger_first_and_sla_stays_in_order():
    policy = TieredPolicy(StreamScore([0.6] * 10), SHARES, reference=np.linspace(0, 1, 101))  # tier 1
    router = Router(TIERS, policy)
    d = router.route("q", 16, exclude={"mid"})
    assert (d.model, d.tier) == ("big", 1) and "no tier-1 model" in d.reason
    slo_router = Router(TIERS, policy, SLO(max_queue=4))
    d = slo_router.route("q", 16, {"mid": LoadStats(queue_len=9)})  # mid overloaded: big before small
    assert (d.model, d.category, d.tier) == ("big", "load", 1)
    d = slo_router.route("q", 16, {"mid": LoadStats(queue_len=9), "big": LoadStats(healthy=False)})
    assert (d.model, d.tier) == ("small", 1)
    router.record_served(d)
    assert router.served.tier_shares()[0] == {"realised": 1.0, "policy": 0.0}


def test_tier_flags_order_by_price_and_validate():
    names = ["big", "small", "mid"]
    costs = {"small": (1e-7, 2e-7), "mid": (1e-6, 2e-6), "big": (1e-5, 3e-5)}
    shares = parse_tier_shares(["big=0.2", "small=0.5", "mid=0.3"], names)
    entries, ordered = tiered_entries(names, costs, shares)
    assert [(e.name, e.rank, e.strong) for e in entries] == [("small", 0, False), ("mid", 1, True), ("big", 2, True)]
    assert ordered == SHARES
    for bad in (["big=0.2", "small=0.5"], ["big=0.2", "small=0.5", "mid=0.4"], ["big=x", "small=0.5", "mid=0.5"],
                ["huge=0.2", "small=0.5", "mid=0.3"]):
        with pytest.raises(ValueError):
            parse_tier_shares(bad, names)


def test_serve_flags_build_a_three_tier_router():
    from test_router_server import router_config

    from pagedlm.server.cli import build_router, describe_router

    names = ["big", "small", "mid"]
    flags = ["--model-cost", "small=0.1,0.2", "--model-cost", "mid=1,2", "--model-cost", "big=10,30",
             "--tier-share", "small=0.5", "--tier-share", "mid=0.3", "--tier-share", "big=0.2",
             "--calibration-window", "200"]
    r = build_router(router_config(*flags), names)
    assert isinstance(r.policy, TieredPolicy) and r.policy.shares == SHARES
    assert [c.target for c in r.policy.calibrators] == pytest.approx([0.5, 0.2])
    assert [m.rank for m in (r.models["small"], r.models["mid"], r.models["big"])] == [0, 1, 2]
    assert "mid (tier 1, 30%)" in describe_router(r)
    for extra in (["--strong-fraction", "0.3"], ["--router", "cascade"], ["--strong-model", "big"]):
        with pytest.raises(ValueError, match="tier-share"):
            build_router(router_config(*flags, *extra), names)


def test_three_tier_server_routes_to_each_tier_within_five_points(tiny_model_dir):
    from server_utils import routed_server

    policy = TieredPolicy(HeuristicPolicy(), SHARES)
    policy.calibrate_live(window=150, min_samples=20)
    router = Router(TIERS, policy, share_window=150)
    rng = np.random.default_rng(1)
    prompts = [f"Question {i}: " + "why " * int(n) + "?" for i, n in enumerate(rng.integers(1, 120, size=300))]
    assert len({round(HeuristicPolicy().score(extract_features(p, 1)), 6) for p in prompts}) > 100
    with routed_server(tiny_model_dir, router, names=("small", "mid", "big")) as (server, _, _):
        routed = []
        for p in prompts:
            r = server.post("/v1/completions", json={"model": "auto", "prompt": p, "max_tokens": 1})
            assert r.status_code == 200, r.text
            routed.append(r.headers["x-pagedlm-routed-model"])
        metrics = server.metrics(all_labels=True)
    last = np.array(routed[-150:])
    for name, share in zip(("small", "mid", "big"), SHARES):
        assert abs((last == name).mean() - share) <= 0.05, (name, (last == name).mean())
        k = ("small", "mid", "big").index(name)
        assert metrics[f"pagedlm:router_tier_share{{kind=target,model={name},tier={k}}}"] == share
        assert metrics[f"pagedlm:router_tier_share{{kind=realised,model={name},tier={k}}}"] == \
            pytest.approx((last == name).mean())
