"""Router quality machinery without models: baselines, domain folds, prompt features, boosted-tree heads and the
gain-target classifier (synthetic data, seconds)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pagedlm.router import HeuristicPolicy, ModelEntry, Router, extract_features
from pagedlm.router.baselines import heuristic_scores, knn_scores, length_scores, tune_knn
from pagedlm.router.classifier import WeakCorrectClassifier, build_inputs
from pagedlm.router.domains import MMLU_GROUPS, SUBJECT_GROUP, subject_groups
from pagedlm.router.evaluate import call_performance_curve
from pagedlm.router.features import FEATURE_NAMES, feature_matrix, prompt_features
from pagedlm.router.heads import BoostedTrees
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
    assert apgr["heuristic"] == pytest.approx(apgr["length"])  # multiple choice: the heuristic ranks by length
    assert apgr["oracle"] == max(apgr.values())


def test_heuristic_ranks_multiple_choice_by_length_but_free_form_by_kind():
    h = HeuristicPolicy()
    prompts = [mc("What is " + "very " * k + "likely?") for k in range(0, 60, 3)]
    prompts += [mc("Compute 3 + 4 * " + "2 + " * k + "1") for k in range(0, 60, 7)]
    scores = [h.score(extract_features(p)) for p in prompts]
    assert np.array_equal(np.argsort(scores, kind="stable"), np.argsort(length_scores(prompts), kind="stable"))
    free = [h.score(extract_features(p)) for p in ("Tell me about Rome.", "Solve 3x + 4 = 19 for x.")]
    assert free[1] > free[0] + 0.2  # a free-form math request still reads as harder


def test_prompt_features_read_form_not_topic():
    f = dict(zip(FEATURE_NAMES, prompt_features(mc("Which of the following is NOT a prime? Compute 7 * 3 = ?",
                                                  ("21", "7", "3", "2")))))
    assert f["negated"] == 1 and f["which_of_following"] == 1 and f["computation"] == 1
    assert f["numeric_choices"] == 1 and f["multiple_choice"] == 1 and f["log_numbers"] > np.log1p(5)
    g = dict(zip(FEATURE_NAMES, prompt_features("Tell me a story about a cat.")))
    assert g["negated"] == g["multiple_choice"] == g["numeric_choices"] == 0 and g["log_chars"] > 0
    assert feature_matrix([]).shape == (0, len(FEATURE_NAMES))
    for hostile in ("\n" * 100_000, "Statement 1 " * 20_000, "A." * 50_000):
        t0 = time.perf_counter()
        prompt_features(hostile)
        assert time.perf_counter() - t0 < 2.0


def test_boosted_trees_match_sklearn_and_round_trip():
    from sklearn.ensemble import GradientBoostingClassifier

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2000, 5)).astype(np.float32)
    labels = np.stack([x[:, 0] + rng.normal(size=2000) > 0, x[:, 1] * x[:, 2] > 0], axis=1)
    trees = BoostedTrees.fit(x, labels, trees=40, min_samples_leaf=20, ensemble=3, seed=7)
    for j in range(2):  # the mean logit of three stochastic boosters
        ref = np.mean([GradientBoostingClassifier(n_estimators=40, learning_rate=0.05, max_depth=3, min_samples_leaf=20,
                                                  subsample=0.8, random_state=7 + k).fit(x, labels[:, j])
                       .decision_function(x) for k in range(3)], axis=0)
        np.testing.assert_allclose(trees.logits(x)[:, j], ref, rtol=1e-5, atol=1e-5)
    back = BoostedTrees.from_state(trees.state())
    np.testing.assert_array_equal(back.logits(x[:50]), trees.logits(x[:50]))



def _walk(trees: BoostedTrees, row: np.ndarray) -> np.ndarray:
    """The logits of one row by walking each tree's nodes (the stored arrays, as sklearn reads them)."""
    outputs, n, _ = trees.feature.shape
    leaf_values = np.zeros((outputs, n), np.float32)
    for j in range(outputs):
        for t in range(n):
            node = 0
            while trees.feature[j, t, node] >= 0:
                f = trees.feature[j, t, node]
                node = (trees.left if row[f] <= trees.threshold[j, t, node] else trees.right)[j, t, node]
            leaf_values[j, t] = trees.value[j, t, node]
    return trees.base + leaf_values.sum(1)


def test_boosted_trees_level_layout_gives_the_node_walks_logits():
    """Evaluated level by level as complete trees (shallow leaves filling their subtrees), the logits are bit for
    bit those of walking each tree's nodes, rows on the thresholds and NaN included; a label of one class is a
    constant."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(600, 4)).astype(np.float32)
    labels = np.stack([x[:, 0] > 0.8, np.ones(600, bool), x[:, 1] + x[:, 3] > 0], axis=1)
    trees = BoostedTrees.fit(x, labels, trees=30, min_samples_leaf=150, ensemble=2, seed=1)
    assert ((trees.feature[0] >= 0).sum(1) < 7).any() and (trees.feature[1] < 0).all()  # shallow leaves; a constant
    at_roots = np.tile(trees.threshold[0, :4, 0][:, None], (1, 4)).astype(np.float32)  # rows at the roots' splits
    rows = np.vstack([x[:40], at_roots, [[np.nan, 0, 0, np.nan]]]).astype(np.float32)
    got = trees.logits(rows)
    for row, logit in zip(rows, got):
        np.testing.assert_array_equal(logit, _walk(trees, np.asarray(row, np.float64)))

def test_gain_target_ranks_where_the_strong_model_helps(tmp_path):
    """Two kinds of hard prompt: one the strong model solves, one nobody does. The weak target cannot tell them
    apart; the gain target sends the first strong and leaves the second."""
    rng = np.random.default_rng(4)
    n = 1200
    kind = rng.integers(0, 3, size=n)  # 0 easy, 1 strong helps, 2 nobody solves
    x = np.eye(3, dtype=np.float32)[kind] + 0.1 * rng.normal(size=(n, 3)).astype(np.float32)
    w = np.where(kind == 0, rng.random(n) < 0.9, rng.random(n) < 0.2)
    s = np.where(kind == 2, rng.random(n) < 0.2, rng.random(n) < 0.95)
    gain = WeakCorrectClassifier.fit(x, w, kind="gbm", strong_correct=s)
    weak = WeakCorrectClassifier.fit(x, w, kind="logreg")
    sc = gain.strong_score(x)
    assert sc[kind == 1].mean() > max(sc[kind == 0].mean(), sc[kind == 2].mean()) + 0.5
    assert call_performance_curve(sc, w, s).apgr > call_performance_curve(weak.strong_score(x), w, s).apgr + 0.1
    gain.save(tmp_path / "g.pt")
    back = WeakCorrectClassifier.load(tmp_path / "g.pt")
    np.testing.assert_allclose(back.strong_score(x), sc)
    assert (back.target, back.kind, back.inputs) == ("gain", "gbm", "embedding")


def test_feature_inputs_are_standardised_and_need_no_embedder():
    prompts = [mc("Why " * k + "?") for k in range(1, 80)] + [f"What is {k} + {k}?" for k in range(80)]
    w = np.array([len(p) < 60 for p in prompts])
    feats = feature_matrix(prompts)
    clf = WeakCorrectClassifier.fit(build_inputs("features", None, feats), w, kind="logreg", inputs="features")
    assert not clf.uses_embedding and clf._embedder is None
    np.testing.assert_allclose(clf.score_texts(prompts[:5]), clf.strong_score(feats[:5]))
    assert abs(((feats - clf.shift) / clf.scale).mean(0)).max() < 1e-4
    with pytest.raises(ValueError, match="need"):
        build_inputs("embedding+features", None, feats)


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


def test_router_latency_bench_runs_every_policy_open_loop():
    from pagedlm.bench.router_latency import _prompts, run

    router = Router([ModelEntry("w"), ModelEntry("s", strong=True)], HeuristicPolicy())
    out = run(router, _prompts(None, 50, seed=0), rate=400.0, seconds=0.1, seed=0)
    assert out["decisions"] == 40 and out["p50_ms"] <= out["p95_ms"] <= out["p99_ms"] and out["rate"] > 0


def test_fold_report_prints_apgr_and_cpt_per_fold(capsys):
    from pagedlm.router.report import print_folds

    curve = {"router": {"APGR": 0.614, "CPT(50%)": 29.71}, "length": {"APGR": 0.536, "CPT(50%)": 40.2}}
    print_folds({"mode": "leave_domain_out", "recipe": {"kind": "gbm", "inputs": "features", "target": "gain",
                                                        "embedder": "l128-L0"},
                 "folds": [{"fold": "STEM", "prompts": 3018, "curves": curve, "share_at_50": 0.465}],
                 "summary": {"router": {"mean": 0.614, "min_margin_over_length": 0.078},
                             "length": {"mean": 0.536, "min_margin_over_length": 0.0}}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["APGR", "prompts", "router", "length", "share@50%"]
    assert lines[2].split() == ["STEM", "3018", "0.614", "0.536", "46.5%"]
    assert lines[5:] == [f"{'CPT(50%)':<16}{'prompts':>8}{'router':>10}{'length':>10}",
                         f"{'STEM':<16}{3018:>8}{'29.7%':>10}{'40.2%':>10}"]
