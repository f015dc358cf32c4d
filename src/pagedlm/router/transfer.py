"""Evaluation that cannot flatter: a router's curve always beside the trivial baselines', and transfer measured on
folds of whole domains the router was not trained on.

`compare` scores one split: the router, the prompt's length, a k-NN over the same embeddings (fit on the same
training rows), the heuristic, random routing and the oracle. `evaluate_folds` re-trains the router's recipe on
all but each fold and compares on the fold; `domain_folds` are MMLU's four subject groups (`domains.py`),
`subject_folds` seeded groups of whole subjects.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedlm.router.baselines import knn_scores, length_scores, tune_knn
from pagedlm.router.evaluate import Curve, call_performance_curve, optimal_curve, random_curve

BASELINES = ("length", "k-NN", "heuristic", "random", "oracle")

# train rows -> (strong scores of the test rows, the threshold sending 50% of the training rows strong)
FitRouter = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, float]]


@dataclass
class Comparison:
    curves: dict[str, Curve]  # "router" and each of BASELINES
    knn_k: int

    def table(self) -> dict[str, dict[str, float]]:
        return {name: c.summary() for name, c in self.curves.items()}


def compare(router_scores: np.ndarray, test: np.ndarray, train: np.ndarray, prompts: Sequence[str],
            weak_correct: np.ndarray, strong_correct: np.ndarray, embeddings: np.ndarray,
            heuristic: np.ndarray, seed: int = 0) -> Comparison:
    """Curves of the router (its scores of the `test` rows) and of every baseline on the `test` rows; the k-NN is
    fit on the `train` rows' embeddings, its k chosen on a validation share of them."""
    w, s = weak_correct[test], strong_correct[test]
    k = tune_knn(embeddings[train], weak_correct[train], strong_correct[train], seed)
    knn = knn_scores(embeddings[train], weak_correct[train], embeddings[test], k)
    curves = {"router": call_performance_curve(router_scores, w, s),
              "length": call_performance_curve(length_scores([prompts[i] for i in test]), w, s),
              "k-NN": call_performance_curve(knn, w, s),
              "heuristic": call_performance_curve(heuristic[test], w, s),
              "random": random_curve(w, s), "oracle": optimal_curve(w, s)}
    return Comparison(curves, k)


@dataclass
class FoldResult:
    name: str
    subjects: list[str]
    prompts: int
    comparison: Comparison
    share_at_50: float  # share of the fold the router sends strong at its 50% training threshold
    apgr: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        self.apgr = {k: c.apgr for k, c in self.comparison.curves.items()}

    def as_dict(self) -> dict:
        return {"fold": self.name, "subjects": self.subjects, "prompts": self.prompts, "knn_k": self.comparison.knn_k,
                "share_at_50": self.share_at_50, "curves": self.comparison.table()}


def domain_folds(subjects: Sequence[str]) -> list[tuple[str, np.ndarray]]:
    """One fold per MMLU group present: (group name, boolean mask of its rows)."""
    from pagedlm.router.domains import MMLU_GROUPS, subject_groups

    groups = subject_groups(subjects)
    return [(g, groups == g) for g in MMLU_GROUPS if (groups == g).any()]


def subject_folds(subjects: Sequence[str], folds: int, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """`folds` folds of whole subjects (a seeded shuffle, dealt round-robin)."""
    names = sorted(set(subjects))
    if not 2 <= folds <= len(names):
        raise ValueError(f"folds must be in [2, {len(names)}] (the data has {len(names)} subjects)")
    np.random.default_rng(seed).shuffle(names)
    subj = np.asarray(subjects)
    return [(f"fold {k}", np.isin(subj, names[k::folds])) for k in range(folds)]


def evaluate_folds(folds: Sequence[tuple[str, np.ndarray]], fit_router: FitRouter, prompts: Sequence[str],
                   subjects: Sequence[str], weak_correct: np.ndarray, strong_correct: np.ndarray,
                   embeddings: np.ndarray, heuristic: np.ndarray, seed: int = 0) -> list[FoldResult]:
    """For each fold: train on every other row, compare on the fold's rows."""
    out = []
    for name, mask in folds:
        test, train = np.flatnonzero(mask), np.flatnonzero(~mask)
        scores, threshold = fit_router(train, test)
        cmp = compare(scores, test, train, prompts, weak_correct, strong_correct, embeddings, heuristic, seed)
        out.append(FoldResult(name, sorted({subjects[i] for i in test}), len(test), cmp,
                              float((scores >= threshold).mean())))
    return out


def summarize(folds: Sequence[FoldResult]) -> dict[str, dict[str, float]]:
    """Per method: mean APGR over the folds, and its worst margin over the length baseline."""
    methods = list(folds[0].apgr)
    return {m: {"mean": float(np.mean([f.apgr[m] for f in folds])),
                "min_margin_over_length": float(min(f.apgr[m] - f.apgr["length"] for f in folds))}
            for m in methods}
