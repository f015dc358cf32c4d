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
    s = e.add_argument_group("transfer to unseen subjects")
    s.add_argument("--by-subject", action="store_true",
                   help="cross-validate by subject: train the router's kind on all but a fold of whole subjects, "
                        "report APGR on the held-out subjects")
    s.add_argument("--folds", type=int, default=5)
    s.add_argument("--features", default="embedding", choices=["embedding", "embedding+stats"],
                   help="for --by-subject: the router's embedding, or with the prompt's own statistics appended")
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
    from pagedlm.paths import cache_dir
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
        "router": str(args.router), "data": str(args.data),
        "held_out": len(test), "held_out_subjects": len(set(test.subjects)),
        "weak_acc": float(w.mean()), "strong_acc": float(s.mean()),
        "curves": {k: c.summary() for k, c in curves.items()},
        "realised_strong_share": calibration,
        "latency_ms": {"median": float(np.median(times)), "p90": float(np.percentile(times, 90)),
                       "p95": float(np.percentile(times, 95)), "threads": args.latency_threads},
        "embedder": clf.embedder_config.tag(),
        "plot": str(args.plot),
    }
    if args.calibrate_on:
        report["live_calibration"] = live_calibration_report(clf, args, embedder)
    if args.by_subject:
        report["by_subject"] = by_subject_report(clf, data, args, embedder)
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
    if args.calibrate_on:
        print()
        _print_calibration(report["live_calibration"], args.tolerance)
    if args.by_subject:
        print()
        _print_by_subject(report["by_subject"])
    return 0


def _fractions(text: str) -> list[float]:
    try:
        out = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--strong-fractions {text!r}: expected numbers like 0.2,0.5") from None
    if not out or not all(0.0 < f < 1.0 for f in out):
        raise SystemExit(f"--strong-fractions {text!r}: each share must be in (0, 1)")
    return out


def live_calibration_report(clf, args: argparse.Namespace, embedder) -> dict:
    """Static (offline threshold) vs live-calibrated routing on the `--calibrate-on` stream."""
    from pagedlm.router.calibration import population_stability_index
    from pagedlm.router.data import load_routing_data, split_indices
    from pagedlm.router.evaluate import pgr_of, share_trace, simulate_routing

    fractions = _fractions(args.strong_fractions)
    if args.calibration_window < 1:
        raise SystemExit("--calibration-window must be >= 1")
    m = clf.meta
    data = load_routing_data(args.calibrate_on)
    own = m.get("data") is not None and Path(m["data"]).resolve() == Path(args.calibrate_on).resolve()
    idx = split_indices(data, m.get("test_fraction", 0.3), m.get("seed", 0), m.get("by_subject", False))[1] \
        if own else np.arange(len(data))
    if args.stream_order == "subject":
        idx = np.array(sorted(idx, key=lambda i: (data.subjects[i], i)))
    else:
        idx = np.random.default_rng(args.stream_seed).permutation(idx)
    stream = data.take(idx)
    scores = clf.strong_score(_embed(embedder, data, idx, _cache_dir(args.cache_dir)))
    window = min(args.calibration_window, len(idx))
    out = {"stream": str(args.calibrate_on), "held_out_split": own, "order": args.stream_order,
           "prompts": len(idx), "subjects": len(set(stream.subjects)), "window": window,
           "psi_vs_training": population_stability_index(clf.train_scores, scores), "targets": {}}
    for f in fractions:
        row = {}
        for mode in ("static", "live"):
            strong = simulate_routing(scores, clf.threshold_for(f), f, mode == "live", clf.train_scores,
                                      window=window, min_samples=min(50, window))
            trace = share_trace(strong, f, window)
            every = slice(None, None, window)
            row[mode] = {"share": float(strong.mean()), **trace.summary(args.tolerance),
                         "pgr": pgr_of(strong, stream.weak_correct, stream.strong_correct),
                         "over_time": {"requests": trace.ends[every].tolist(),
                                       "share": [round(float(v), 4) for v in trace.share[every]]}}
        out["targets"][str(f)] = row
    return out


def by_subject_report(clf, data, args: argparse.Namespace, embedder) -> dict:
    """Subject-held-out cross-validation: the router's kind and embedder, trained on all subjects but one fold,
    scored on the fold's subjects; APGR of it, the heuristic and random routing on each fold."""
    from pagedlm.router.classifier import WeakCorrectClassifier
    from pagedlm.router.evaluate import call_performance_curve, random_curve
    from pagedlm.router.policies import HeuristicPolicy, extract_features

    subjects = sorted(set(data.subjects))
    if not 2 <= args.folds <= len(subjects):
        raise SystemExit(f"--folds must be in [2, {len(subjects)}] (the data has {len(subjects)} subjects)")
    seed = clf.meta.get("seed", 0)
    np.random.default_rng(seed).shuffle(subjects)
    x = _embed(embedder, data, np.arange(len(data)), _cache_dir(args.cache_dir))
    stats = prompt_stats(data.prompts) if args.features == "embedding+stats" else None
    heuristic = HeuristicPolicy()
    h = np.array([heuristic.score(extract_features(p)) for p in data.prompts])
    subj = np.array(data.subjects)
    folds = []
    for k in range(args.folds):
        held = subjects[k::args.folds]
        test = np.isin(subj, held)
        xs = x
        if stats is not None:
            mu, sd = stats[~test].mean(0), stats[~test].std(0) + 1e-6
            xs = np.hstack([x, (stats - mu) / sd]).astype(np.float32)
        c = WeakCorrectClassifier.fit(xs[~test], data.weak_correct[~test], kind=clf.kind, seed=seed,
                                      embedder=clf.embedder_config)
        scores = c.strong_score(xs[test])
        w, s = data.weak_correct[test], data.strong_correct[test]
        folds.append({"subjects": sorted(held), "prompts": int(test.sum()),
                      "classifier": call_performance_curve(scores, w, s).apgr,
                      "heuristic": call_performance_curve(h[test], w, s).apgr,
                      "random": random_curve(w, s).apgr,
                      "share_at_50": float((scores >= c.threshold_for(0.5)).mean())})
    mean = {k: float(np.mean([f[k] for f in folds])) for k in ("classifier", "heuristic", "random", "share_at_50")}
    return {"folds": folds, "mean": mean, "kind": clf.kind, "embedder": clf.embedder_config.tag(),
            "features": args.features}


def prompt_stats(prompts: list[str]) -> np.ndarray:
    """The prompt's own statistics: log length (characters, words, lines), shares of digits, capitals,
    punctuation and math symbols, mean word length, the four answer choices' mean log length, and the
    heuristic's question-type flags."""
    from pagedlm.router.policies import extract_features

    kinds = ("code", "math", "reasoning", "multiple_choice", "factual", "open")
    rows = []
    for p in prompts:
        n = max(1, len(p))
        words = p.split()
        lines = p.splitlines()
        choices = [ln for ln in lines if len(ln) > 2 and ln[0] in "ABCD" and ln[1] in ".)"]
        f = extract_features(p)
        rows.append([np.log1p(len(p)), np.log1p(len(words)), np.log1p(len(lines)),
                     sum(ch.isdigit() for ch in p) / n, sum(ch.isupper() for ch in p) / n,
                     sum(ch in ",.;:!?()[]'\"" for ch in p) / n, sum(ch in "+-*/=^<>%$\\" for ch in p) / n,
                     np.mean([len(w) for w in words]) if words else 0.0,
                     np.mean([np.log1p(len(c)) for c in choices]) if choices else 0.0,
                     float(f.has_code), float(f.has_math), *(float(f.question_type == k) for k in kinds)])
    return np.array(rows, dtype=np.float32)


def _print_by_subject(r: dict) -> None:
    print(f"subject-held-out cross-validation ({len(r['folds'])} folds of whole subjects; {r['kind']} on "
          f"{r['features']}, embedder {r['embedder']}): APGR on the held-out subjects")
    print(f"{'fold':>4} {'subjects':>9} {'prompts':>8} {'classifier':>11} {'heuristic':>10} {'random':>7} "
          f"{'share@50%':>10}")
    for i, f in enumerate(r["folds"]):
        print(f"{i:>4} {len(f['subjects']):>9} {f['prompts']:>8} {f['classifier']:>11.3f} {f['heuristic']:>10.3f} "
              f"{f['random']:>7.3f} {f['share_at_50']:>10.1%}")
    m = r["mean"]
    print(f"{'mean':>4} {'':>9} {'':>8} {m['classifier']:>11.3f} {m['heuristic']:>10.3f} {m['random']:>7.3f} "
          f"{m['share_at_50']:>10.1%}")


def _print_calibration(r: dict, tolerance: float) -> None:
    split = "held-out split of the router's data" if r["held_out_split"] else "all of it"
    print(f"live calibration: {r['prompts']} prompts from {r['stream']} ({split}; {r['subjects']} subjects, "
          f"{r['order']} order), window {r['window']}; score drift vs training: PSI {r['psi_vs_training']:.3f}")
    print(f"share error over the last {r['window']} requests, at each request after the first window "
          f"(on target: within +-{tolerance:.0%}):")
    print(f"{'target':>7} | {'static: share':>13} {'mean err':>9} {'max err':>8} {'on tgt':>7} {'PGR':>6} | "
          f"{'live: share':>11} {'mean err':>9} {'max err':>8} {'on tgt':>7} {'PGR':>6}")
    for f, row in r["targets"].items():
        cells = [f"{row[k]['share']:>{w}.1%} {row[k]['mean_abs_error']:>9.1%} {row[k]['max_abs_error']:>8.1%} "
                 f"{row[k]['within_tolerance']:>7.0%} {row[k]['pgr']:>6.3f}" for k, w in (("static", 13),
                                                                                      ("live", 11))]
        print(f"{float(f):>7.0%} | {cells[0]} | {cells[1]}")
    targets = list(r["targets"])
    print(f"strong share over time (last {r['window']} requests), static -> live:")
    print(f"{'requests':>9} " + " ".join(f"{'target ' + format(float(f), '.0%'):>17}" for f in targets))
    first = r["targets"][targets[0]]["static"]["over_time"]["requests"]
    for i, n in enumerate(first):
        cells = [f"{r['targets'][f]['static']['over_time']['share'][i]:>7.1%} -> "
                 f"{r['targets'][f]['live']['over_time']['share'][i]:>6.1%}" for f in targets]
        print(f"{n:>9} " + " ".join(f"{c:>17}" for c in cells))


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
