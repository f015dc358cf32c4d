"""Classifier heads of the learned router: input rows -> one logit per label (P(weak correct), and where trained so,
P(strong correct)).

- `TorchHead`: logistic regression (full-batch L-BFGS) or a one-hidden-layer MLP (AdamW), binary cross-entropy;
- `BoostedTrees`: gradient-boosted regression trees on the log loss, fitted with scikit-learn's
  GradientBoostingClassifier and kept as plain arrays (read through its public `tree_` attributes), evaluated
  here with numpy: a router file never holds a pickle.
Both serialise to plain tensors and numbers (`torch.load(weights_only=True)` reads them back).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


def _torch_module(kind: str, dim: int, hidden: int, outputs: int) -> nn.Module:
    if kind == "logreg":
        return nn.Linear(dim, outputs)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, outputs))
    raise ValueError(f"head kind must be 'logreg', 'mlp' or 'gbm', got {kind!r}")


class TorchHead:
    def __init__(self, kind: str, module: nn.Module, hidden: int) -> None:
        self.kind, self.module, self.hidden = kind, module.eval(), hidden

    @classmethod
    def fit(cls, kind: str, x: np.ndarray, labels: np.ndarray, hidden: int = 128, weight_decay: float = 1e-3,
            epochs: int = 40, seed: int = 0) -> "TorchHead":
        """`labels`: [n, outputs] in {0, 1}."""
        torch.manual_seed(seed)
        xt = torch.from_numpy(np.asarray(x, dtype=np.float32))
        yt = torch.from_numpy(np.asarray(labels, dtype=np.float32))
        module = _torch_module(kind, xt.shape[1], hidden, yt.shape[1])
        loss_fn = nn.BCEWithLogitsLoss()
        if kind == "logreg":
            opt = torch.optim.LBFGS(module.parameters(), max_iter=200, line_search_fn="strong_wolfe")

            def closure():
                opt.zero_grad()
                loss = loss_fn(module(xt), yt) + weight_decay * module.weight.pow(2).sum()
                loss.backward()
                return loss
            opt.step(closure)
        else:
            opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=weight_decay)
            gen = torch.Generator().manual_seed(seed)
            for _ in range(epochs):
                for idx in torch.randperm(len(xt), generator=gen).split(128):
                    opt.zero_grad()
                    loss_fn(module(xt[idx]), yt[idx]).backward()
                    opt.step()
        return cls(kind, module, hidden)

    @torch.inference_mode()
    def logits(self, x: np.ndarray) -> np.ndarray:
        return self.module(torch.as_tensor(x, dtype=torch.float32)).double().numpy()

    def state(self) -> dict:
        return {"kind": self.kind, "hidden": self.hidden, "state": self.module.state_dict()}

    @classmethod
    def from_state(cls, blob: dict) -> "TorchHead":
        state = blob["state"]
        weights = [v for k, v in state.items() if k.endswith("weight")]
        module = _torch_module(blob["kind"], weights[0].shape[1], blob["hidden"], weights[-1].shape[0])
        module.load_state_dict(state)
        return cls(blob["kind"], module, blob["hidden"])


class BoostedTrees:
    """One ensemble of regression trees per output: logit = base + sum over trees of the reached leaf's value.
    Arrays are [outputs, trees, nodes] (padded); a node with feature -1 is a leaf; rows go left when
    `x[feature] <= threshold`.

    Evaluated as complete trees of `depth` levels, level by level: level l holds every tree's 2**l nodes side by
    side (heap order), and a leaf above the last level stands for itself down to it. A row reads each level's
    arrays front to back (about 170 kB for the default router's 1,500 trees) rather than nodes gathered from
    everywhere: between requests they are out of cache, and that gathering was most of the classifier's time."""

    kind = "gbm"

    def __init__(self, base: np.ndarray, feature: np.ndarray, threshold: np.ndarray, left: np.ndarray,
                 right: np.ndarray, value: np.ndarray, depth: int) -> None:
        self.base, self.feature, self.threshold = base, feature, threshold
        self.left, self.right, self.value, self.depth = left, right, value, depth
        self._tested, self._thresholds, self._leaves = _complete_levels(feature, threshold, left, right, value, depth)
        n = feature.shape[0] * feature.shape[1]
        self._offsets = [np.arange(n) << level for level in range(depth + 1)]  # where each tree's level starts

    @classmethod
    def fit(cls, x: np.ndarray, labels: np.ndarray, trees: int = 150, learning_rate: float = 0.05,
            max_depth: int = 3, min_samples_leaf: int | None = None, subsample: float = 0.8, ensemble: int = 5,
            seed: int = 0) -> "BoostedTrees":
        """Per label, the average logit of `ensemble` stochastic boosters (each tree fit on a `subsample` of the
        rows; seeds seed, seed+1, ...): bagging the boosters steadies the ranking. `min_samples_leaf`: default
        1% of the rows, at most 100."""
        from sklearn.ensemble import GradientBoostingClassifier

        x = np.asarray(x, dtype=np.float32)
        if min_samples_leaf is None:
            min_samples_leaf = max(1, min(100, len(x) // 100))
        fitted = []  # per label: (base logit, [(tree, weight)])
        for j in range(labels.shape[1]):
            y = np.asarray(labels[:, j], dtype=bool)
            p = (y.sum() + 0.5) / (len(y) + 1.0)
            members = []
            if y.any() and not y.all():  # else: one class only, a constant logit
                for k in range(ensemble):
                    gb = GradientBoostingClassifier(n_estimators=trees, learning_rate=learning_rate,
                                                    max_depth=max_depth, min_samples_leaf=min_samples_leaf,
                                                    subsample=subsample, random_state=seed + k).fit(x, y)
                    members += [(e.tree_, gb.learning_rate / ensemble) for e in gb.estimators_[:, 0]]
            fitted.append((np.log(p / (1 - p)) if not members else np.log(y.mean() / (1 - y.mean())), members))
        nodes = max([tr.node_count for _, t in fitted for tr, _ in t] or [1])
        shape = (len(fitted), max([len(t) for _, t in fitted] + [1]), nodes)
        feature, left, right = np.full(shape, -1, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        threshold, value = np.zeros(shape, np.float64), np.zeros(shape, np.float32)
        for j, (_, members) in enumerate(fitted):
            for t, (tr, weight) in enumerate(members):
                n = tr.node_count
                leaf = tr.children_left[:n] == -1
                feature[j, t, :n] = np.where(leaf, -1, tr.feature[:n])
                threshold[j, t, :n] = tr.threshold[:n]
                left[j, t, :n] = np.where(leaf, 0, tr.children_left[:n])
                right[j, t, :n] = np.where(leaf, 0, tr.children_right[:n])
                value[j, t, :n] = weight * tr.value[:n, 0, 0]
        base = np.array([b for b, _ in fitted], dtype=np.float64)
        return cls(base, feature, threshold, left, right, value, max_depth)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """[rows, outputs]; every output's trees walked together, one level per step."""
        x = np.asarray(x, dtype=np.float64)
        outputs, trees, _ = self.feature.shape
        out = np.empty((len(x), outputs))
        for r, row in enumerate(x):  # a request routes one prompt: per row, 1-D gathers are the cheapest
            pos = np.zeros(outputs * trees, np.intp)  # the node reached, within its tree's level
            for level in range(self.depth):
                at = self._offsets[level] + pos
                go_left = row.take(self._tested[level].take(at)) <= self._thresholds[level].take(at)
                pos = 2 * pos + 1 - go_left
            out[r] = self.base + self._leaves.take(self._offsets[self.depth] + pos).reshape(outputs, trees).sum(1)
        return out

    def state(self) -> dict:
        return {"kind": "gbm", "depth": self.depth, "base": torch.from_numpy(self.base),
                **{k: torch.from_numpy(getattr(self, k)) for k in ("feature", "threshold", "left", "right", "value")}}

    @classmethod
    def from_state(cls, blob: dict) -> "BoostedTrees":
        arrays = {k: blob[k].numpy() for k in ("base", "feature", "threshold", "left", "right", "value")}
        return cls(depth=int(blob["depth"]), **arrays)


def _complete_levels(feature: np.ndarray, threshold: np.ndarray, left: np.ndarray, right: np.ndarray,
                     value: np.ndarray, depth: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """The trees as complete ones, level-major: per level l < depth, the feature tested and its threshold at each
    tree's 2**l nodes ([trees * 2**l], tree after tree), and the 2**depth leaf values of each tree. A leaf above
    the last level fills its subtree: its tests are never decisive (feature 0, threshold 0) and its value is at
    every leaf below it."""
    flat = feature.shape[0] * feature.shape[1]
    tested = [np.zeros(flat << level, np.int32) for level in range(depth)]
    thresholds = [np.zeros(flat << level, np.float64) for level in range(depth)]
    leaves = np.zeros(flat << depth, value.dtype)
    f, t, lc, rc, v = (a.reshape(flat, -1) for a in (feature, threshold, left, right, value))
    for k in range(flat):
        stack = [(0, 0, 0)]  # (node, level, position within the level)
        while stack:
            node, level, pos = stack.pop()
            if level == depth:
                if f[k, node] >= 0:
                    raise ValueError(f"a tree is deeper than its stated depth {depth}")
                leaves[(k << depth) + pos] = v[k, node]
            elif f[k, node] < 0:
                stack += [(node, level + 1, 2 * pos), (node, level + 1, 2 * pos + 1)]
            else:
                tested[level][(k << level) + pos], thresholds[level][(k << level) + pos] = f[k, node], t[k, node]
                stack += [(lc[k, node], level + 1, 2 * pos), (rc[k, node], level + 1, 2 * pos + 1)]
    return tested, thresholds, leaves


def head_from_state(blob: dict) -> TorchHead | BoostedTrees:
    return BoostedTrees.from_state(blob) if blob["kind"] == "gbm" else TorchHead.from_state(blob)
