"""Routing data sets: prompts with per-model correctness (RouteLLM's MMLU responses format)."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WEAK_COLUMN = "mistralai/Mixtral-8x7B-Instruct-v0.1"
STRONG_COLUMN = "gpt-4-1106-preview"


@dataclass
class RoutingData:
    prompts: list[str]
    subjects: list[str]
    weak_correct: np.ndarray  # [n] bool
    strong_correct: np.ndarray  # [n] bool

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, idx: np.ndarray) -> "RoutingData":
        return RoutingData([self.prompts[i] for i in idx], [self.subjects[i] for i in idx],
                           self.weak_correct[idx], self.strong_correct[idx])


def load_routing_data(path: str | Path, weak: str = WEAK_COLUMN, strong: str = STRONG_COLUMN) -> RoutingData:
    """A CSV file, or a directory (searched recursively) of `<subject>.csv` files with columns
    `prompt`, `weak`, `strong` (True/False). Rows are in sorted-file order."""
    path = Path(path)
    files = sorted(path.rglob("*.csv")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no CSV files under {path}")
    prompts, subjects, w, s = [], [], [], []
    for f in files:
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                prompts.append(row["prompt"])
                subjects.append(f.stem.removeprefix("mmlu_"))
                w.append(row[weak].strip().lower() == "true")
                s.append(row[strong].strip().lower() == "true")
    return RoutingData(prompts, subjects, np.array(w), np.array(s))


def split(data: RoutingData, test_fraction: float = 0.3, seed: int = 0,
          by_subject: bool = False) -> tuple[RoutingData, RoutingData]:
    """Disjoint (train, test): a seeded shuffle of the prompts, or of whole subjects with `by_subject`."""
    train, test = split_indices(data, test_fraction, seed, by_subject)
    return data.take(train), data.take(test)


def split_indices(data: RoutingData, test_fraction: float = 0.3, seed: int = 0,
                  by_subject: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if by_subject:
        names = sorted(set(data.subjects))
        rng.shuffle(names)
        held = set(names[: max(1, round(len(names) * test_fraction))])
        test = np.array([s in held for s in data.subjects])
    else:
        test = np.zeros(len(data), dtype=bool)
        test[rng.permutation(len(data))[: round(len(data) * test_fraction)]] = True
    return np.flatnonzero(~test), np.flatnonzero(test)
