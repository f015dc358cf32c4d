"""Shared pieces of the benchmarks: request sets, statistics, tables, JSON."""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any, Sequence


def make_prompts(vocab_size: int, num: int, input_len: int, seed: int = 0,
                 avoid: Sequence[int] = ()) -> list[list[int]]:
    """`num` prompts of exactly `input_len` random token ids (the same for every backend, no padding needed)."""
    rng = random.Random(seed)
    skip = set(avoid)
    pool = [t for t in range(min(vocab_size, 32000)) if t not in skip]
    return [[rng.choice(pool) for _ in range(input_len)] for _ in range(num)]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
