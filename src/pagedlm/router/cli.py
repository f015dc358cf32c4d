"""`pagedlm router train DATA --out FILE` and `pagedlm router eval DATA --router FILE` (report.py)."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_RECIPE = {"inputs": "features", "kind": "gbm", "target": "gain"}


def add_router_parser(subparsers) -> None:
    from pagedlm.router.report import cmd_eval

    p = subparsers.add_parser("router", help="train and evaluate the request router offline")
    sub = p.add_subparsers(dest="router_cmd", required=True)

    t = sub.add_parser("train", help="train the learned router on a routing data set (its training split)")
    t.add_argument("data", help="CSV file or directory of CSVs (prompt, weak, strong correctness)")
    t.add_argument("--out", required=True, help="router file to write")
    t.add_argument("--inputs", default=DEFAULT_RECIPE["inputs"],
                   choices=["features", "embedding", "embedding+features"],
                   help="features: the prompt's form (length, numbers, question form, reading level; no embedding "
                        "model at serving time); embedding: all-MiniLM-L6-v2; or both")
    t.add_argument("--kind", default=DEFAULT_RECIPE["kind"], choices=["gbm", "logreg", "mlp"],
                   help="head: gradient-boosted trees, logistic regression or an MLP")
    t.add_argument("--target", default=DEFAULT_RECIPE["target"], choices=["gain", "weak"],
                   help="gain: P(strong correct) - P(weak correct); weak: 1 - P(weak correct)")
    t.add_argument("--max-length", type=int, default=None,
                   help="prompt tokens the embedder reads (default 128; more: slower routing)")
    t.add_argument("--layers", type=int, default=None,
                   help="encoder layers to run: 0 (default) pools the token embeddings alone, 6 is the full "
                        "all-MiniLM-L6-v2 (about 20x slower per prompt on CPU)")
    t.add_argument("--int8", action="store_true", help="int8 dynamic quantization of the encoder layers run")
    _split_args(t)
    t.add_argument("--cache-dir", default=None,
                   help="embedding and feature cache (default: <model cache>/router; 'none': off)")
    t.set_defaults(fn=cmd_train)

    k = sub.add_parser("train-cascade", help="fit the cascade's escalation scorer on weak answers labelled right or "
                                             "wrong (for serve --cascade-scorer FILE)")
    k.add_argument("data", help="JSONL: one answer a line, {\"token_logprobs\": [...], \"samples\": [texts, "
                                "optional], \"weak_correct\": true|false}")
    k.add_argument("--out", required=True, help="scorer file (JSON) to write")
    k.add_argument("--folds", type=int, default=5, help="cross-validation folds for the reported AUC")
    k.add_argument("--seed", type=int, default=0)
    k.set_defaults(fn=cmd_train_cascade)

    e = sub.add_parser("eval", help="call-performance curve, APGR and CPT on the held-out prompts, beside the "
                                    "length, k-NN, heuristic, random and oracle baselines")
    e.add_argument("data")
    e.add_argument("--router", required=True, help="router file from `pagedlm router train`")
    e.add_argument("--plot", default="router_curve.png", help="PNG to write")
    e.add_argument("--latency-samples", type=int, default=100)
    e.add_argument("--latency-threads", type=int, default=1,
                   help="torch threads while timing one-prompt routing (0: leave as is)")
    e.add_argument("--cache-dir", default=None)
    e.add_argument("--json", action="store_true")
    c = e.add_argument_group("live calibration (simulated on a prompt stream)")
    c.add_argument("--calibrate-on", default=None, metavar="DATA",
                   help="stream these prompts (CSV file or directory; the router's own data: its held-out split) "
                        "through the router with its offline threshold and with live calibration; report the "
                        "strong share over time")
    c.add_argument("--stream-order", default="subject", choices=["subject", "shuffled"],
                   help="subject: whole subjects one after another (the score distribution shifts at each); "
                        "shuffled: a seeded random order")
    c.add_argument("--strong-fractions", default="0.2,0.5,0.8", help="target strong shares, comma-separated")
    c.add_argument("--calibration-window", type=int, default=500, help="live calibration window (requests)")
    c.add_argument("--tolerance", type=float, default=0.05, help="share error counted as on target")
    c.add_argument("--stream-seed", type=int, default=0, help="seed of the shuffled order")
    s = e.add_argument_group("transfer to unseen subjects and domains (the router's recipe re-trained per fold)")
    s.add_argument("--leave-domain-out", action="store_true",
                   help="MMLU data: train on three of its four subject groups (STEM, humanities, social sciences, "
                        "other), report every router and baseline on the fourth, for each fold")
    s.add_argument("--by-subject", action="store_true",
                   help="cross-validate by subject: train on all but a fold of whole subjects, report on the fold")
    s.add_argument("--folds", type=int, default=5)
    e.set_defaults(fn=cmd_eval)


def _split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--test-fraction", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--by-subject", action="store_true", help="hold out whole subjects instead of random prompts")


def cache_dir_arg(arg: str | None) -> Path | None:
    if arg == "none":
        return None
    if arg:
        return Path(arg)
    from pagedlm.paths import cache_dir
    return cache_dir() / "router"


@dataclass(frozen=True)
class Recipe:
    """How a router is trained: what it reads, its head, its target and how prompts are embedded."""

    inputs: str
    kind: str
    target: str
    embedder: object  # EmbedderConfig

    @classmethod
    def of(cls, clf) -> "Recipe":
        return cls(clf.inputs, clf.kind, clf.target, clf.embedder_config)


class Rows:
    """A data set's embeddings and prompt features, computed once (and cached on disk) for every row."""

    def __init__(self, prompts: list[str], embedder_config, cache: Path | None) -> None:
        self.prompts, self.embedder_config, self.cache = prompts, embedder_config, cache
        self._emb: np.ndarray | None = None
        self._feat: np.ndarray | None = None
        self.embedder = None

    @property
    def embeddings(self) -> np.ndarray:
        if self._emb is None:
            from pagedlm.router.embedding import Embedder, embed_cached

            self.embedder = self.embedder or Embedder(config=self.embedder_config)
            self._emb = embed_cached(self.embedder, self.prompts, self.cache)
        return self._emb

    @property
    def features(self) -> np.ndarray:
        if self._feat is None:
            from pagedlm.router.embedding import cached_rows
            from pagedlm.router.features import FEATURES_VERSION, feature_matrix

            self._feat = cached_rows(self.prompts, self.cache, f"feat-v{FEATURES_VERSION}-{{}}", feature_matrix)
        return self._feat

    def inputs(self, recipe: Recipe) -> np.ndarray:
        from pagedlm.router.classifier import build_inputs

        return build_inputs(recipe.inputs, self.embeddings if "embedding" in recipe.inputs else None,
                            self.features if "features" in recipe.inputs else None)


def fit_recipe(recipe: Recipe, x: np.ndarray, weak: np.ndarray, strong: np.ndarray, seed: int):
    from pagedlm.router.classifier import WeakCorrectClassifier

    return WeakCorrectClassifier.fit(x, weak, kind=recipe.kind, seed=seed, embedder=recipe.embedder,
                                     strong_correct=strong if recipe.target == "gain" else None, inputs=recipe.inputs)


def cmd_train(args: argparse.Namespace) -> int:
    from pagedlm.router.data import load_routing_data, split_indices
    from pagedlm.router.embedding import FAST_EMBEDDER, EmbedderConfig

    data = load_routing_data(args.data)
    train_idx, test_idx = split_indices(data, args.test_fraction, args.seed, args.by_subject)
    config = EmbedderConfig(args.max_length or FAST_EMBEDDER.max_length, args.int8,
                            FAST_EMBEDDER.layers if args.layers is None else args.layers)
    recipe = Recipe(args.inputs, args.kind, args.target, config)
    start = time.perf_counter()
    x = Rows(data.prompts, config, cache_dir_arg(args.cache_dir)).inputs(recipe)[train_idx]
    inputs_s = time.perf_counter() - start
    clf = fit_recipe(recipe, x, data.weak_correct[train_idx], data.strong_correct[train_idx], args.seed)
    clf.meta = {"test_fraction": args.test_fraction, "seed": args.seed, "by_subject": args.by_subject,
                "train_size": len(train_idx), "data": str(args.data)}
    clf.save(args.out)
    acc = float(((clf.predict(x) >= 0.5) == data.weak_correct[train_idx]).mean())
    print(f"trained {args.kind} on {args.inputs} (target {args.target}) of {len(train_idx)} prompts "
          f"({len(test_idx)} held out; inputs {inputs_s:.0f}s); weak-correct train accuracy {acc:.3f}; "
          f"wrote {args.out}")
    return 0


def cmd_train_cascade(args: argparse.Namespace) -> int:
    import json

    from pagedlm.router.answer import EscalationScorer, WeakAnswer, answer_features
    from pagedlm.router.cascade import SamplesCost, describe_costs

    rows, labels, costs = [], [], []
    with open(args.data) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append(answer_features(WeakAnswer.of(row["token_logprobs"], row.get("samples") or ())))
                labels.append(bool(row["weak_correct"]))
                if "sample_tokens" in row:
                    costs.append(SamplesCost(int(row["prompt_tokens"]), tuple(map(int, row["sample_tokens"]))))
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{args.data}:{n}: expected token_logprobs and weak_correct ({e})") from None
    x, y = np.array(rows), np.array(labels)
    if len(set(labels)) < 2 or not 2 <= args.folds <= min(y.sum(), (~y).sum()):
        raise SystemExit(f"{args.data}: need answers labelled both right and wrong, at least --folds of each")
    folds = np.array_split(np.random.default_rng(args.seed).permutation(len(y)), args.folds)
    held = np.zeros(len(y))
    for f in folds:  # each answer scored by a scorer fit without it
        rest = np.setdiff1d(np.arange(len(y)), f)
        held[f] = EscalationScorer.fit(x[rest], y[rest]).score_features(x[f])
    scorer = EscalationScorer.fit(x, y)
    scorer.save(args.out)
    report = ", ".join(f"{name} {_auc(s, y):.3f}" for name, s in
                       (("fitted", held), ("prior", EscalationScorer.prior().score_features(x)),
                        ("mean logprob", EscalationScorer.mean_logprob().score_features(x))))
    print(f"fit on {len(y)} answers ({(~y).mean():.1%} wrong); AUC of wrong vs right ({args.folds}-fold "
          f"cross-validated for the fit): {report}; wrote {args.out}")
    if costs and len(costs) == len(labels):
        print(describe_costs(costs))
    return 0


def _auc(scores: np.ndarray, right: np.ndarray) -> float:
    """P(a wrong answer scores above a right one), ties half (nan without both)."""
    wrong, ok = scores[~right], scores[right]
    if not len(wrong) or not len(ok):
        return float("nan")
    return float((wrong[:, None] > ok[None, :]).mean() + 0.5 * (wrong[:, None] == ok[None, :]).mean())
