"""Router evaluation machinery without models: baselines, domain folds (synthetic data, seconds)."""
from __future__ import annotations

import numpy as np
import pytest

from pagedlm.router.baselines import heuristic_scores, knn_scores, length_scores, tune_knn
from pagedlm.router.domains import MMLU_GROUPS, SUBJECT_GROUP, subject_groups
from pagedlm.router.evaluate import call_performance_curve
from pagedlm.router.transfer import BASELINES, compare, domain_folds, evaluate_folds, subject_folds, summarize


def mc(stem: str, choices=("one", "two", "three", "four")) -> str:
    return stem + "\n" + "\n".join(f"{k}. {c}" for k, c in zip("ABCD", choices)) + "\nAnswer:"


def test_mmlu_groups_are_the_four_standard_categories():
    assert {g: len(s) for g, s in MMLU_GROUPS.items()} == {"STEM": 18, "humanities": 13, "social sciences": 12,
                                                          "other": 14}
    assert len(SUBJECT_GROUP) == 57  # every subject in exactly one group
    assert list(subject_groups(["college_physics", "philosophy", "sociology", "virology"])) == \
        ["STEM", "humanities", "social sciences", "other"]
    with pytest.raises(ValueError, match="not MMLU subjects"):
        subject_groups(["philosophy", "cooking"])


def test_knn_matches_brute_force():
    rng = np.random.default_rng(0)
    train = rng.normal(size=(200, 8)).astype(np.float32)
    train /= np.linalg.norm(train, axis=1, keepdims=True)
    test = rng.normal(size=(30, 8)).astype(np.float32)
    y = rng.random(200) < 0.6
    got = knn_scores(train, y, test, k=7, chunk=4)
    for i, row in enumerate(test):
        nearest = np.argsort(-(train @ row))[:7]
        assert got[i] == pytest.approx(1 - y[nearest].mean())
    assert np.allclose(knn_scores(train, y, test, k=500), 1 - y.mean())  # k past the data: the base rate


def test_knn_k_is_tuned_on_training_rows():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(600, 4)).astype(np.float32)
    w = x[:, 0] + 0.3 * rng.normal(size=600) > 0  # a smooth signal: a larger k averages the noise away
    s = np.ones(600, dtype=bool)
    assert tune_knn(x, w, s, ks=(1, 50)) == 50


def test_compare_reports_every_baseline_on_the_test_rows():
    rng = np.random.default_rng(2)
    n = 400
    prompts = [mc("Q" * int(k)) for k in rng.integers(5, 300, size=n)]
    lengths = length_scores(prompts)
    w = rng.random(n) > lengths / lengths.max()  # longer: the weak model fails more often
    s = rng.random(n) < 0.9
    emb = rng.normal(size=(n, 6)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    train, test = np.arange(0, 300), np.arange(300, n)
    cmp = compare(-lengths[test], test, train, prompts, w, s, emb, heuristic_scores(prompts))
    assert set(cmp.curves) == {"router", *BASELINES}
    apgr = {k: c.apgr for k, c in cmp.curves.items()}
    assert apgr["length"] == pytest.approx(call_performance_curve(lengths[test], w[test], s[test]).apgr)
    assert apgr["router"] < 0.5 < apgr["length"]  # the router here ranks backwards
    assert apgr["oracle"] == max(apgr.values())


def test_folds_retrain_per_fold_and_summarise():
    rng = np.random.default_rng(5)
    subjects = [s for s in ("college_physics", "philosophy", "sociology", "virology") for _ in range(60)]
    prompts = [mc("Q" * int(k)) for k in rng.integers(5, 200, size=len(subjects))]
    w, s = rng.random(len(subjects)) < 0.6, rng.random(len(subjects)) < 0.9
    emb = rng.normal(size=(len(subjects), 4)).astype(np.float32)
    seen = []

    def fit(train, test):
        seen.append((set(train), set(test)))
        return -length_scores([prompts[i] for i in test]), 0.0

    folds = domain_folds(subjects)
    assert [name for name, _ in folds] == ["STEM", "humanities", "social sciences", "other"]
    results = evaluate_folds(folds, fit, prompts, subjects, w, s, emb, heuristic_scores(prompts))
    assert all(not (tr & te) and len(tr | te) == len(subjects) for tr, te in seen)
    assert [r.subjects for r in results] == [["college_physics"], ["philosophy"], ["sociology"], ["virology"]]
    summary = summarize(results)
    assert summary["length"]["min_margin_over_length"] == 0.0
    assert summary["router"]["mean"] == pytest.approx(np.mean([r.apgr["router"] for r in results]))
    assert len(subject_folds(subjects, 2)) == 2
    with pytest.raises(ValueError):
        subject_folds(subjects, 5)
