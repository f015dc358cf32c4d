"""`pagedlm router train DATA --out FILE` and `pagedlm router eval DATA --router FILE`."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROUTELLM_MMLU = "RouteLLM published (MMLU, best routers): APGR ~0.60, CPT(50%) ~35%"


def add_router_parser(subparsers) -> None:
    p = subparsers.add_parser("router", help="train and evaluate the request router offline")
    sub = p.add_subparsers(dest="router_cmd", required=True)

    t = sub.add_parser("train", help="train the learned router on a routing data set (its training split)")
    t.add_argument("data", help="CSV file or directory of CSVs (prompt, weak, strong correctness)")
    t.add_argument("--out", required=True, help="router file to write")
    t.add_argument("--kind", default="logreg", choices=["logreg", "mlp"])
    t.add_argument("--max-length", type=int, default=None,
                   help="prompt tokens the embedder reads (default 128; more: slower routing)")
    t.add_argument("--layers", type=int, default=None,
                   help="encoder layers to run: 0 (default) pools the token embeddings alone, 6 is the full "
                        "all-MiniLM-L6-v2 (about 20x slower per prompt on CPU)")
    t.add_argument("--int8", action="store_true", help="int8 dynamic quantization of the encoder layers run")
    _split_args(t)
    t.add_argument("--cache-dir", default=None, help="embedding cache (default: <model cache>/router; 'none': off)")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="call-performance curve, APGR and CPT on the held-out prompts")
    e.add_argument("data")
    e.add_argument("--router", required=True, help="router file from `pagedlm router train`")
    e.add_argument("--plot", default="router_curve.png", help="PNG to write")
    e.add_argument("--latency-samples", type=int, default=100)
    e.add_argument("--latency-threads", type=int, default=1,
                   help="torch threads while timing one-prompt routing (0: leave as is)")
    e.add_argument("--cache-dir", default=None)
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=cmd_eval)


def _split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--test-fraction", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--by-subject", action="store_true", help="hold out whole subjects instead of random prompts")


def _cache_dir(arg: str | None) -> Path | None:
    if arg == "none":
        return None
    if arg:
        return Path(arg)
    from pagedlm.model.registry import cache_dir
    return cache_dir() / "router"


def _embed(embedder, data, idx: np.ndarray, cache: Path | None) -> np.ndarray:
    """Embeddings of `data.prompts[idx]`; with a cache, the whole data set is embedded (once) and indexed."""
    from pagedlm.router.classifier import embed_cached

    if cache is None:
        return embedder.encode([data.prompts[i] for i in idx])
    return embed_cached(embedder, data.prompts, cache)[idx]


def cmd_train(args: argparse.Namespace) -> int:
    from pagedlm.router.classifier import FAST_EMBEDDER, Embedder, EmbedderConfig, WeakCorrectClassifier
    from pagedlm.router.data import load_routing_data, split_indices

    data = load_routing_data(args.data)
    train_idx, test_idx = split_indices(data, args.test_fraction, args.seed, args.by_subject)
    train = data.take(train_idx)
    config = EmbedderConfig(args.max_length or FAST_EMBEDDER.max_length, args.int8,
                            FAST_EMBEDDER.layers if args.layers is None else args.layers)
    start = time.perf_counter()
    x = _embed(Embedder(config=config), data, train_idx, _cache_dir(args.cache_dir))
    embed_s = time.perf_counter() - start
    clf = WeakCorrectClassifier.fit(x, train.weak_correct, kind=args.kind, seed=args.seed, embedder=config)
    clf.meta = {"test_fraction": args.test_fraction, "seed": args.seed, "by_subject": args.by_subject,
                "train_size": len(train), "data": str(args.data)}
    clf.save(args.out)
    acc = float(((clf.predict(x) >= 0.5) == train.weak_correct).mean())
    print(f"trained {args.kind} on {len(train)} prompts, embedder {config.tag()} ({len(test_idx)} held out; "
          f"embeddings {embed_s:.0f}s); "
          f"train accuracy {acc:.3f}; wrote {args.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pagedlm.router.classifier import Embedder, WeakCorrectClassifier
    from pagedlm.router.data import load_routing_data, split_indices
    from pagedlm.router.evaluate import call_performance_curve, optimal_curve, plot_curves, random_curve
    from pagedlm.router.policies import ClassifierPolicy, HeuristicPolicy, extract_features

    clf = WeakCorrectClassifier.load(args.router)
    m = clf.meta
    data = load_routing_data(args.data)
    _, test_idx = split_indices(data, m.get("test_fraction", 0.3), m.get("seed", 0), m.get("by_subject", False))
    test = data.take(test_idx)
    embedder = Embedder(config=clf.embedder_config)
    scores = clf.strong_score(_embed(embedder, data, test_idx, _cache_dir(args.cache_dir)))
    heuristic = HeuristicPolicy()
    h_scores = np.array([heuristic.score(extract_features(p)) for p in test.prompts])
    w, s = test.weak_correct, test.strong_correct
    curves = {f"classifier ({clf.kind})": call_performance_curve(scores, w, s),
              "heuristic": call_performance_curve(h_scores, w, s),
              "random": random_curve(w, s), "optimal": optimal_curve(w, s)}
    plot_curves(curves, args.plot, f"MMLU held-out ({len(test)} prompts)")
    calibration = {f: float((scores >= clf.threshold_for(f)).mean()) for f in (0.2, 0.5, 0.8)}

    clf._embedder = embedder
    policy = ClassifierPolicy(clf)
    samples = [test.prompts[i] for i in np.random.default_rng(0).permutation(len(test))[:args.latency_samples]]
    times = _time_routing(policy, samples, args.latency_threads)
    report = {
        "held_out": len(test), "weak_acc": float(w.mean()), "strong_acc": float(s.mean()),
        "curves": {k: c.summary() for k, c in curves.items()},
        "realised_strong_share": calibration,
        "latency_ms": {"median": float(np.median(times)), "p90": float(np.percentile(times, 90)),
                       "p95": float(np.percentile(times, 95)), "threads": args.latency_threads},
        "embedder": clf.embedder_config.tag(),
        "plot": str(args.plot),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"held-out prompts: {len(test)}  weak acc {w.mean():.3f}  strong acc {s.mean():.3f}")
    print(f"{'router':<22}{'APGR':>8}{'CPT(50%)':>10}{'CPT(80%)':>10}{'PGR@50%':>9}")
    for name, r in report["curves"].items():
        print(f"{name:<22}{r['APGR']:>8.3f}{r['CPT(50%)']:>9.1f}%{r['CPT(80%)']:>9.1f}%{r['PGR@50%']:>9.3f}")
    print(ROUTELLM_MMLU)
    print("calibration (target -> realised strong share on held-out): "
          + ", ".join(f"{k:.0%} -> {v:.1%}" for k, v in calibration.items()))
    lat = report["latency_ms"]
    print(f"classifier latency per request (embedder {report['embedder']}): median {lat['median']:.1f} ms, "
          f"p90 {lat['p90']:.1f} ms, p95 {lat['p95']:.1f} ms (CPU, {len(times)} prompts, "
          f"{torch_threads(args.latency_threads)} torch threads)")
    print(f"plot: {args.plot}")
    return 0


def torch_threads(requested: int) -> int:
    import torch
    return requested or torch.get_num_threads()


def _time_routing(policy, prompts: list[str], threads: int) -> list[float]:
    """Milliseconds per one-prompt routing decision (after a warm-up), with `threads` torch threads."""
    import torch

    from pagedlm.router.policies import extract_features

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        policy.score(extract_features(prompts[0]))
        times = []
        for p in prompts:
            t0 = time.perf_counter()
            policy.score(extract_features(p))
            times.append(1000 * (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(before)
    return times
