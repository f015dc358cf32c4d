"""The trivial routers a learned one must beat, as strong scores (higher: send to the strong model).

- length: the prompt's length in characters (longer prompts are harder; on MMLU it is level with learned routers);
- k-NN: 1 - the weak model's accuracy on the k training prompts nearest by cosine similarity, over the same
  embeddings as the router (k chosen on a validation split of the training prompts);
- heuristic: `HeuristicPolicy`, what `model: "auto"` uses without a trained classifier.
Random routing and the oracle are curves of their own (`evaluate.random_curve`, `evaluate.optimal_curve`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KNN_KS = (10, 25, 50, 100, 200)


def length_scores(prompts: Sequence[str]) -> np.ndarray:
    return np.array([len(p) for p in prompts], dtype=np.float64)


def heuristic_scores(prompts: Sequence[str]) -> np.ndarray:
    from pagedlm.router.policies import HeuristicPolicy, extract_features

    h = HeuristicPolicy()
    return np.array([h.score(extract_features(p)) for p in prompts], dtype=np.float64)


def knn_scores(train_x: np.ndarray, train_weak_correct: np.ndarray, test_x: np.ndarray, k: int,
               chunk: int = 1024) -> np.ndarray:
    """1 - the mean weak-correct label of each test row's `k` most similar training rows (rows L2-normalised:
    the dot product is the cosine)."""
    train_x = np.asarray(train_x, dtype=np.float32)
    y = np.asarray(train_weak_correct, dtype=np.float64)
    k = max(1, min(k, len(train_x)))
    out = np.empty(len(test_x))
    for lo in range(0, len(test_x), chunk):
        sims = np.asarray(test_x[lo:lo + chunk], dtype=np.float32) @ train_x.T
        idx = np.argpartition(-sims, k - 1, axis=1)[:, :k] if k < len(train_x) else None
        out[lo:lo + chunk] = 1.0 - (y[idx].mean(1) if idx is not None else np.full(len(sims), y.mean()))
    return out


def tune_knn(train_x: np.ndarray, weak_correct: np.ndarray, strong_correct: np.ndarray, seed: int = 0,
             ks: Sequence[int] = KNN_KS, validation: float = 0.2) -> int:
    """The k of `ks` with the best APGR on a seeded `validation` share of the training rows (fit on the rest)."""
    from pagedlm.router.evaluate import call_performance_curve

    n = len(train_x)
    perm = np.random.default_rng(seed).permutation(n)
    val, fit = perm[:max(1, round(n * validation))], perm[max(1, round(n * validation)):]
    if len(fit) < 2 or len(val) < 2:
        return min(ks)
    best = max(ks, key=lambda k: call_performance_curve(
        knn_scores(train_x[fit], weak_correct[fit], train_x[val], k), weak_correct[val],
        strong_correct[val]).apgr)
    return int(best)
