"""The start-up probe of the kernel/GEMM crossover: its rule, its cache, and a disturbed reading not kept."""
from __future__ import annotations

import pytest
import torch

from pagedlm.model import probe

BUSY = probe._busy  # the real one (the `cache` fixture replaces it)


def _timings(crossover: int) -> dict[int, tuple[float, float]]:
    """Kernel faster than the dense GEMM up to `crossover` rows, slower above."""
    return {r: (1.0, 2.0) if r <= crossover else (2.0, 1.0) for r in probe.ROWS}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "_busy", lambda: False)  # the suite's own load must not decide these
    return tmp_path


def test_crossover_is_the_last_row_count_before_the_kernel_loses():
    assert probe._crossover(_timings(8)) == 8
    assert probe._crossover(_timings(0)) == 1  # never below one row
    mixed = {**_timings(16), 4: (2.0, 1.0)}  # a loss at 4 rows ends the run even if 8 and 16 win again
    assert probe._crossover(mixed) == 2


def test_agreeing_rounds_are_cached_and_read_back(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(probe, "_time_paths", lambda *a: calls.append(a) or _timings(8))
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32)
    assert rows == 8 and "measured" in why and len(calls) == probe.ROUNDS
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32)
    assert rows == 8 and "cached" in why and len(calls) == probe.ROUNDS  # no new measurement


def test_disagreeing_rounds_take_the_larger_kept_unsettled_for_a_day(cache, monkeypatch):
    """Rounds that disagree (a busy machine) keep the larger answer as unsettled: the next starts use it without a
    probe of their own, and a start a day later probes again and settles it."""
    import os

    readings = iter([_timings(1), _timings(8), _timings(16), _timings(16)])  # the first round was disturbed
    monkeypatch.setattr(probe, "_time_paths", lambda *a: next(readings))
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32)
    assert rows == 8 and "unsettled" in why
    (path,) = cache.rglob("probe-*.json")
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32)  # no probe: the unsettled answer
    assert rows == 8 and "cached" in why and "unsettled" in why
    day_ago = path.stat().st_mtime - probe.RETRY_S - 1
    os.utime(path, (day_ago, day_ago))
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32)  # probed again, now stable
    assert rows == 16 and "measured" in why and "unsettled" not in why
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32)
    assert rows == 16 and "cached" in why and "unsettled" not in why


def test_rounds_taken_on_a_busy_machine_are_kept_unsettled(cache, monkeypatch):
    """Other work disturbs both rounds alike, so they can agree on a wrong answer: taken while the load average is
    high, it is kept unsettled (probed again a day later), not settled for good."""
    monkeypatch.setattr(probe, "_time_paths", lambda *a: _timings(2))
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (4.0 * (probe.os.cpu_count() or 1), 0.0, 0.0))
    monkeypatch.setattr(probe, "_busy", BUSY)
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32)
    assert rows == 2 and "unsettled" in why and "busy" in why
    assert "unsettled" in probe.measure_kernel_max_rows("int4", 32, torch.float32)[1]


@pytest.mark.parametrize("top, probes", [((1.0, 2.0), 1), ((1.0, 1.2), 1 + probe.ROUNDS)])
def test_without_a_dense_copy_a_clear_win_at_the_most_rows_settles_it(cache, monkeypatch, top, probes):
    """Big steps of a model with no dense copy dequantize the whole weight first, a cost fewer rows cannot amortize:
    a kernel clearly faster at the most rows takes every step, settled, after one short timing (not the rounds);
    a close call there runs the rounds."""
    from pagedlm.config import KERNEL_MAX_ROWS

    calls = []

    def timings(*args):
        calls.append(args)
        return {max(probe.ROWS): top} if args[5:6] == ((max(probe.ROWS),),) else _timings(8)

    monkeypatch.setattr(probe, "_time_paths", timings)
    rows, why = probe.measure_kernel_max_rows("int4", 32, torch.float32, copy=False)
    assert len(calls) == probes and calls[0][5:] == ((max(probe.ROWS),), probe.QUICK_REPEATS)
    assert rows == (KERNEL_MAX_ROWS if probes == 1 else 8) and "unsettled" not in why
    assert "cached" in probe.measure_kernel_max_rows("int4", 32, torch.float32, copy=False)[1]
    probe.measure_kernel_max_rows("int4", 32, torch.float32, copy=True)  # with a copy: the rounds, as before
    assert len(calls) == probes + probe.ROUNDS and all(len(c) == 5 for c in calls[probes:])
