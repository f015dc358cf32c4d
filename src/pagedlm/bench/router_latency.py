"""Router decision latency under load: `python -m pagedlm.bench.router_latency [--router router.pt] [options]`.

Requests arrive open-loop (Poisson, `--rate` a second, for `--seconds`) and each is routed by `Router.route` on one
worker thread, as the server's `Dispatcher` does; a decision's latency runs from its arrival to its result, so time
spent queued behind earlier decisions counts. Policies: the heuristic, the learned router of `--router` (if given),
and three tiers over the same score, each live-calibrated. `--cpus 0,1` pins the process to those cores (default:
the first two), and torch runs on one thread. Prints one JSON line per policy: decisions, achieved rate, median /
p95 / p99 latency and the mean service time.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _prompts(data: str | None, n: int, seed: int) -> list[str]:
    if data:
        from pagedlm.router.data import load_routing_data

        prompts = load_routing_data(data).prompts
        return [prompts[i] for i in np.random.default_rng(seed).integers(0, len(prompts), size=n)]
    rng = np.random.default_rng(seed)
    words = "why how what which explain prove compute the a of matrix river history law cell energy".split()
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 300)))) + "?" for _ in range(n)]


def _routers(args: argparse.Namespace) -> dict:
    from pagedlm.router import HeuristicPolicy, ModelEntry, Router
    from pagedlm.router.tiers import TieredPolicy

    two = [ModelEntry("weak"), ModelEntry("strong", strong=True)]
    three = [ModelEntry("small", tier=0), ModelEntry("mid", True, tier=1), ModelEntry("big", True, tier=2)]
    heuristic = HeuristicPolicy()
    heuristic.calibrate_live(0.5)
    tiers = TieredPolicy(HeuristicPolicy(), [0.5, 0.3, 0.2])
    tiers.calibrate_live()
    out = {"heuristic": Router(two, heuristic), "heuristic, 3 tiers": Router(three, tiers)}
    if args.router:
        from pagedlm.router.classifier import WeakCorrectClassifier
        from pagedlm.router.policies import ClassifierPolicy

        out["learned"] = Router.learned(args.router, "weak", "strong")
        clf = WeakCorrectClassifier.load(args.router)
        learned_tiers = TieredPolicy(ClassifierPolicy(clf), [0.5, 0.3, 0.2], clf.train_scores)
        learned_tiers.calibrate_live()
        out["learned, 3 tiers"] = Router(three, learned_tiers)
    return out


def run(router, prompts: list[str], rate: float, seconds: float, seed: int) -> dict:
    """Open-loop Poisson arrivals at `rate`/s for `seconds`; decisions on one worker thread."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(1, int(rate * seconds)))
    latency, service = np.zeros(len(gaps)), np.zeros(len(gaps))
    done = threading.Event()
    left = [len(gaps)]

    def decide(i: int, arrival: float) -> None:
        t0 = time.perf_counter()
        router.route(prompts[i % len(prompts)], 256)
        t1 = time.perf_counter()
        latency[i], service[i] = t1 - arrival, t1 - t0
        left[0] -= 1
        if not left[0]:
            done.set()

    router.route(prompts[0], 256, observe=False)  # warm-up (loads what the policy loads)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="router") as pool:
        start = time.perf_counter()
        arrival = start
        for i, gap in enumerate(gaps):
            arrival += gap
            while (wait := arrival - time.perf_counter()) > 0:
                time.sleep(min(wait, 0.002))
            pool.submit(decide, i, arrival)
        done.wait()
        elapsed = time.perf_counter() - start
    ms = 1000 * latency
    return {"decisions": len(gaps), "rate": round(len(gaps) / elapsed, 1), "p50_ms": round(float(np.median(ms)), 3),
            "p95_ms": round(float(np.percentile(ms, 95)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "service_mean_ms": round(float(1000 * service.mean()), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default=None, help="router file from `pagedlm router train` (adds the learned policy)")
    p.add_argument("--data", default=None, help="routing data (CSV or directory) to draw prompts from; default: "
                                                "synthetic prompts of 5-300 words")
    p.add_argument("--rate", type=float, default=100.0, help="decisions a second (Poisson arrivals)")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--cpus", default="0,1", help="cores to pin the process to ('' : leave as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", action="append", default=None,
                   help="a policy to run, by its printed name (repeatable; default: all)")
    args = p.parse_args(argv)
    import torch

    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    torch.set_num_threads(1)
    prompts = _prompts(args.data, 5000, args.seed)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for name, router in _routers(args).items():
        if args.policy and name not in args.policy:
            continue
        result = run(router, prompts, args.rate, args.seconds, args.seed)
        print(json.dumps({"policy": name, **result, "cpus": args.cpus, "load_average_1m": load}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
