"""The disk tier's write budget (--kv-disk-write-share): runs beyond it are neither copied nor written and stay in
memory, a refilled budget admits them again; the running usage total; files of the old format are rejected."""
from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from test_disk_kv_tier import close_to, engine, generate, prompts, run_files  # noqa: F401 (prompts: a fixture)

from pagedlm.kvcache.disk_format import MAGIC, CorruptFileError, RunHeader, digest
from pagedlm.kvcache.disk_tier import DiskTier, scan_runs
from pagedlm.kvcache.write_budget import WriteBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_budget_skips_when_spent_and_admits_when_refilled():
    clock = Clock()
    budget = WriteBudget(share=0.01, burst_seconds=100, clock=clock)  # holds 1 s of CPU, starts full
    budget.cost_per_byte = 1e-3
    assert budget.take(600) == pytest.approx(0.6)
    assert budget.take(600) == pytest.approx(0.6)  # admitted while positive: the level goes below zero
    assert budget.take(1) is None
    clock.now += 10  # refills 0.1 s: still below zero
    assert budget.take(1) is None
    clock.now += 100
    assert budget.take(100) is not None
    clock.now += 1e6  # never above its capacity
    assert budget.take(0) == 0.0 and budget.level == pytest.approx(1.0)


def test_settle_charges_what_a_write_really_cost():
    clock = Clock()
    budget = WriteBudget(share=0.01, burst_seconds=100, clock=clock)
    budget.cost_per_byte = 1e-6
    charged = budget.take(1000)  # predicted 1 ms
    budget.settle(1000, charged, 2.0)  # it took 2 s
    assert budget.level == pytest.approx(-1.0) and budget.take(1) is None
    assert budget.cost_per_byte > 1e-6  # later runs are predicted dearer


def test_share_of_one_means_no_limit():
    budget = WriteBudget(share=1.0, clock=Clock())
    budget.settle(10, 0.0, 1e9)
    assert budget.take(1 << 40) == 0.0


def test_engine_skips_blocks_beyond_the_budget_and_keeps_them_in_memory(tiny_model_dir, prompts, tmp_path):  # noqa: F811 (the fixture)
    eng = engine(tiny_model_dir, tmp_path, kv_disk_write_share=0.01)
    budget = eng.offload.tier.write_budget
    clock = Clock()
    budget.clock, budget._last, budget.level = clock, clock.now, 0.0  # spent, and no time passes
    first = generate(eng, prompts[:1])
    assert eng.offload.tier.flush() and run_files(tmp_path) == []
    disk = eng.get_stats().disk
    assert disk.writes_skipped > 0 and disk.files_written == 0
    assert close_to(generate(eng, prompts[:1]), first)  # a prefix hit in memory (logits of 1 row, not 85: ulps)
    assert eng.get_stats().prefix_cache_hits > 0
    clock.now += 1e6  # a quiet period refills it
    generate(eng, prompts[1:])
    assert eng.offload.tier.flush() and eng.get_stats().disk.files_written > 0


def test_usage_is_a_running_total_that_matches_a_scan(tmp_path):
    tier = DiskTier(tmp_path, 3 * 8192, {"model": "m"}, record_bytes=1000)
    for tag in range(5):
        hashes = [bytes([tag, i]) * 16 for i in range(2)]
        assert tier.submit(0, hashes, [[tag, i] for i in range(2)], torch.full((2, 1000), tag, dtype=torch.uint8))
        assert tier.flush()
        assert tier.stats.usage_bytes == sum(f.size for f in scan_runs(tmp_path).values()) <= tier.budget
    assert tier.stats.evicted_files == 1 and tier.stats.num_files == 4  # 4 runs of 6,096 bytes fit


def test_a_file_of_the_old_format_is_rejected():
    meta = json.dumps({"namespace": "n", "identity": {}, "start": 0, "record_bytes": 4, "hashes": ["00"],
                       "tokens": [[1]], "digests": ["00"]}).encode()
    old = struct.pack("<8sI16s", b"PLMKVR01", len(meta), digest(meta)) + meta
    old += b"\0" * (-len(old) % 4096) + b"abcd"
    assert MAGIC != b"PLMKVR01"
    with pytest.raises(CorruptFileError):
        RunHeader.decode(io.BytesIO(old).read, len(old))
