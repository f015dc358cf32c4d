"""`pagedlm router eval`: the router against every baseline on its held-out split, and optionally on folds of
unseen domains or subjects (the router's recipe re-trained per fold) and on a live-calibration stream."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pagedlm.router.cli import Recipe, Rows, cache_dir_arg, fit_recipe

ROUTELLM_MMLU = "RouteLLM published (MMLU, best routers): APGR ~0.60, CPT(50%) ~35%"


def cmd_eval(args: argparse.Namespace) -> int:
    from pagedlm.router.baselines import heuristic_scores
    from pagedlm.router.classifier import WeakCorrectClassifier
    from pagedlm.router.data import load_routing_data, split_indices
    from pagedlm.router.evaluate import plot_curves
    from pagedlm.router.policies import ClassifierPolicy
    from pagedlm.router.transfer import compare

    clf = WeakCorrectClassifier.load(args.router)
    m, recipe = clf.meta, Recipe.of(clf)
    data = load_routing_data(args.data)
    train_idx, test_idx = split_indices(data, m.get("test_fraction", 0.3), m.get("seed", 0),
                                        m.get("by_subject", False))
    rows = Rows(data.prompts, clf.embedder_config, cache_dir_arg(args.cache_dir))
    scores = clf.strong_score(rows.inputs(recipe)[test_idx])
    heuristic = heuristic_scores(data.prompts)
    w, s = data.weak_correct, data.strong_correct
    cmp = compare(scores, test_idx, train_idx, data.prompts, w, s, rows.embeddings, heuristic, m.get("seed", 0))
    plot_curves(cmp.curves, args.plot, f"Held-out ({len(test_idx)} prompts)")
    calibration = {f: float((scores >= clf.threshold_for(f)).mean()) for f in (0.2, 0.5, 0.8)}

    clf._embedder = rows.embedder
    samples = [data.prompts[i] for i in np.random.default_rng(0).permutation(test_idx)[:args.latency_samples]]
    times = _time_routing(ClassifierPolicy(clf), samples, args.latency_threads)
    report = {
        "router": str(args.router), "data": str(args.data), "recipe": _recipe_dict(recipe),
        "held_out": len(test_idx), "held_out_subjects": len({data.subjects[i] for i in test_idx}),
        "weak_acc": float(w[test_idx].mean()), "strong_acc": float(s[test_idx].mean()),
        "curves": cmp.table(), "knn_k": cmp.knn_k, "realised_strong_share": calibration,
        "latency_ms": {"median": float(np.median(times)), "p90": float(np.percentile(times, 90)),
                       "p95": float(np.percentile(times, 95)), "threads": args.latency_threads},
        "embedder": clf.embedder_config.tag(), "plot": str(args.plot),
    }
    if args.calibrate_on:
        report["live_calibration"] = live_calibration_report(clf, args, rows)
    for flag, key in ((args.leave_domain_out, "leave_domain_out"), (args.by_subject, "by_subject")):
        if flag:
            report[key] = folds_report(key, recipe, data, rows, heuristic, args.folds, m.get("seed", 0))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"held-out prompts: {len(test_idx)}  weak acc {report['weak_acc']:.3f}  strong acc "
          f"{report['strong_acc']:.3f}  (router: {recipe.kind} on {recipe.inputs}, target {recipe.target}; "
          f"k-NN k={cmp.knn_k} on embedder {report['embedder']})")
    print(f"{'method':<12}{'APGR':>8}{'CPT(50%)':>10}{'CPT(80%)':>10}{'PGR@50%':>9}")
    for name, r in report["curves"].items():
        print(f"{name:<12}{r['APGR']:>8.3f}{r['CPT(50%)']:>9.1f}%{r['CPT(80%)']:>9.1f}%{r['PGR@50%']:>9.3f}")
    print(ROUTELLM_MMLU)
    print("calibration (target -> realised strong share on held-out): "
          + ", ".join(f"{k:.0%} -> {v:.1%}" for k, v in calibration.items()))
    lat = report["latency_ms"]
    print(f"router latency per request: median {lat['median']:.2f} ms, p90 {lat['p90']:.2f} ms, p95 "
          f"{lat['p95']:.2f} ms (CPU, {len(times)} prompts, {torch_threads(args.latency_threads)} torch threads)")
    print(f"plot: {args.plot}")
    if args.calibrate_on:
        print()
        _print_calibration(report["live_calibration"], args.tolerance)
    for key in ("leave_domain_out", "by_subject"):
        if key in report:
            print()
            print_folds(report[key])
    return 0


def _recipe_dict(r: Recipe) -> dict:
    return {"inputs": r.inputs, "kind": r.kind, "target": r.target, "embedder": r.embedder.tag()}


def folds_report(mode: str, recipe: Recipe, data, rows: Rows, heuristic: np.ndarray, folds: int, seed: int) -> dict:
    """Leave-domain-out (MMLU groups) or subject-held-out folds: the router's recipe trained on the rest, every
    router and baseline scored on the fold."""
    from pagedlm.router.transfer import domain_folds, evaluate_folds, subject_folds, summarize

    try:
        fold_masks = domain_folds(data.subjects) if mode == "leave_domain_out" else \
            subject_folds(data.subjects, folds, seed)
    except ValueError as e:
        raise SystemExit(f"--{mode.replace('_', '-')}: {e}") from None
    if len(fold_masks) < 2:
        raise SystemExit(f"--{mode.replace('_', '-')}: the data covers fewer than two folds")
    x = rows.inputs(recipe)
    w, s = data.weak_correct, data.strong_correct

    def fit(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, float]:
        clf = fit_recipe(recipe, x[train], w[train], s[train], seed)
        return clf.strong_score(x[test]), clf.threshold_for(0.5)

    results = evaluate_folds(fold_masks, fit, data.prompts, data.subjects, w, s, rows.embeddings, heuristic, seed)
    return {"mode": mode, "recipe": _recipe_dict(recipe), "folds": [r.as_dict() for r in results],
            "summary": summarize(results)}


def print_folds(r: dict) -> None:
    what = "leave-domain-out (MMLU subject groups)" if r["mode"] == "leave_domain_out" else \
        f"subject-held-out ({len(r['folds'])} folds of whole subjects)"
    rc = r["recipe"]
    print(f"{what}: APGR and CPT(50%) on each held-out fold; router = {rc['kind']} on {rc['inputs']} (target "
          f"{rc['target']}) re-trained on the other folds; k-NN on embedder {rc['embedder']}")
    methods = list(r["folds"][0]["curves"])
    for metric, cell in (("APGR", "{:>10.3f}"), ("CPT(50%)", "{:>9.1f}%")):
        print(f"{metric:<16}{'prompts':>8}" + "".join(f"{m:>10}" for m in methods)
              + (f"{'share@50%':>10}" if metric == "APGR" else ""))
        for f in r["folds"]:
            print(f"{f['fold']:<16}{f['prompts']:>8}" + "".join(cell.format(f["curves"][m][metric]) for m in methods)
                  + (f"{f['share_at_50']:>10.1%}" if metric == "APGR" else ""))
        if metric == "APGR":
            sm = r["summary"]
            print(f"{'mean':<16}{'':>8}" + "".join(f"{sm[m]['mean']:>10.3f}" for m in methods))
            print(f"{'min - length':<16}{'':>8}" + "".join(f"{sm[m]['min_margin_over_length']:>+10.3f}"
                                                         for m in methods))


def _fractions(text: str) -> list[float]:
    try:
        out = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--strong-fractions {text!r}: expected numbers like 0.2,0.5") from None
    if not out or not all(0.0 < f < 1.0 for f in out):
        raise SystemExit(f"--strong-fractions {text!r}: each share must be in (0, 1)")
    return out


def live_calibration_report(clf, args: argparse.Namespace, own_rows: Rows) -> dict:
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
    rows = own_rows if own else Rows(data.prompts, clf.embedder_config, own_rows.cache)
    scores = clf.strong_score(rows.inputs(Recipe.of(clf))[idx])
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
