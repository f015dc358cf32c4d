"""Offline router evaluation, as RouteLLM defines it.

Routing the `k` highest-scored prompts to the strong model gives one point of the call-performance curve
(accuracy against % strong calls). PGR = (acc - acc_weak) / (acc_strong - acc_weak); APGR = the area under PGR
over [0, 1] of strong calls (trapezoids; = RouteLLM's (AUC - weak AUC) / (strong AUC - weak AUC));
CPT(x%) = the % of strong calls at which PGR first reaches x (linear interpolation between points).
A random router has PGR = the strong share in expectation: APGR 0.5, CPT(50%) = 50%.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Curve:
    strong_pct: np.ndarray  # [points], 0 .. 100
    accuracy: np.ndarray  # [points], 0 .. 1
    weak_acc: float
    strong_acc: float

    @property
    def pgr(self) -> np.ndarray:
        return (self.accuracy - self.weak_acc) / (self.strong_acc - self.weak_acc)

    @property
    def apgr(self) -> float:
        x, y = self.strong_pct / 100.0, self.pgr
        return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2))

    def cpt(self, target: float) -> float:
        """% strong calls needed for PGR >= target (nan if never reached)."""
        pgr = self.pgr
        hit = np.flatnonzero(pgr >= target - 1e-12)
        if hit.size == 0:
            return float("nan")
        i = int(hit[0])
        if i == 0:
            return float(self.strong_pct[0])
        x0, x1, y0, y1 = self.strong_pct[i - 1], self.strong_pct[i], pgr[i - 1], pgr[i]
        return float(x0 + (target - y0) / (y1 - y0) * (x1 - x0))

    def summary(self) -> dict[str, float]:
        return {"APGR": self.apgr, "CPT(50%)": self.cpt(0.5), "CPT(80%)": self.cpt(0.8),
                "PGR@50%": float(np.interp(50.0, self.strong_pct, self.pgr))}


def call_performance_curve(scores: np.ndarray, weak_correct: np.ndarray, strong_correct: np.ndarray,
                           points: int = 101) -> Curve:
    """Accuracy when the top-scored `pct`% of prompts go to the strong model, for `points` evenly spaced pct."""
    w, s = np.asarray(weak_correct, float), np.asarray(strong_correct, float)
    n = len(w)
    order = np.argsort(-np.asarray(scores, float), kind="stable")
    gain = np.concatenate([[0.0], np.cumsum((s - w)[order])])  # gain[k]: accuracy gain (x n) of k strong calls
    pct = np.linspace(0.0, 100.0, points)
    k = np.rint(pct / 100.0 * n).astype(int)
    return Curve(k / n * 100.0, (w.sum() + gain[k]) / n, float(w.mean()), float(s.mean()))


def random_curve(weak_correct: np.ndarray, strong_correct: np.ndarray, seeds: int = 20, points: int = 101) -> Curve:
    """The random router's curve, averaged over `seeds` random orders."""
    curves = [call_performance_curve(np.random.default_rng((7919, i)).random(len(weak_correct)), weak_correct,
                                     strong_correct, points) for i in range(seeds)]
    return Curve(curves[0].strong_pct, np.mean([c.accuracy for c in curves], axis=0),
                 curves[0].weak_acc, curves[0].strong_acc)


def optimal_curve(weak_correct: np.ndarray, strong_correct: np.ndarray, points: int = 101) -> Curve:
    """The oracle: strong calls first where only the strong model is right."""
    gain = np.asarray(strong_correct, float) - np.asarray(weak_correct, float)
    return call_performance_curve(gain, weak_correct, strong_correct, points)


def plot_curves(curves: dict[str, Curve], path: str | Path, title: str = "Call-performance curve") -> Path:
    """Accuracy vs % strong calls for each named curve, with the weak/strong accuracies; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in curves.items():
        ax.plot(c.strong_pct, 100 * c.accuracy, label=f"{name} (APGR {c.apgr:.3f})")
    any_curve = next(iter(curves.values()))
    ax.axhline(100 * any_curve.weak_acc, color="grey", ls="--", label="weak model")
    ax.axhline(100 * any_curve.strong_acc, color="red", ls="--", label="strong model")
    ax.set(xlabel="Strong model calls (%)", ylabel="Accuracy (%)", title=title)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


@dataclass
class ShareTrace:
    """Strong share over time on a prompt stream: `share[i]` is the share of the `window` decisions ending at
    request `ends[i]`."""

    ends: np.ndarray
    share: np.ndarray
    target: float

    @property
    def error(self) -> np.ndarray:
        return np.abs(self.share - self.target)

    def summary(self, tolerance: float = 0.05) -> dict[str, float]:
        return {"mean_abs_error": float(self.error.mean()), "max_abs_error": float(self.error.max()),
                "within_tolerance": float((self.error <= tolerance).mean())}


def share_trace(strong: np.ndarray, target: float, window: int) -> ShareTrace:
    """The rolling strong share of `strong` decisions (every request from the first full window on)."""
    strong = np.asarray(strong, dtype=float)
    window = min(window, len(strong))
    share = np.convolve(strong, np.ones(window) / window, mode="valid")
    return ShareTrace(np.arange(window, len(strong) + 1), share, target)


def simulate_routing(scores: np.ndarray, offline_threshold: float, target: float, live: bool,
                     reference: np.ndarray | None = None, **calibrator_kwargs) -> np.ndarray:
    """The strong decisions on a stream of strong scores: at the fixed offline threshold, or with live
    calibration starting from it (`ShareCalibrator`, fed each decision as the server does)."""
    scores = np.asarray(scores, dtype=np.float64)
    if not live:
        return scores >= offline_threshold
    from pagedlm.router.calibration import ShareCalibrator

    cal = ShareCalibrator(target, offline_threshold, reference=reference, **calibrator_kwargs)
    out = np.zeros(len(scores), dtype=bool)
    for i, s in enumerate(scores):
        out[i] = cal.decide(float(s))
        cal.observe(float(s), bool(out[i]))
    return out


def pgr_of(strong: np.ndarray, weak_correct: np.ndarray, strong_correct: np.ndarray) -> float:
    """PGR of one set of routing decisions: the share of the weak-to-strong accuracy gap recovered."""
    w, s = np.asarray(weak_correct, float), np.asarray(strong_correct, float)
    acc = np.where(strong, s, w).mean()
    return float((acc - w.mean()) / (s.mean() - w.mean()))
