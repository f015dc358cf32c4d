"""The kernels' parallel loops (csrc/pool.h): every item runs once, a loop starts after the previous one has
finished, a loop body's own loops run serially on its thread, and a descheduled thread holds up only the chunk it
claimed (the others take the rest of its share)."""
from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

from pagedlm import cbuild

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")

SOURCE = Path(__file__).parent / "csrc" / "pool_probe.cpp"


@pytest.fixture(scope="module")
def probe():
    lib = cbuild.load(SOURCE)
    lib.pool_probe.restype = None
    lib.pool_probe.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def run(n, grain, threads, jobs=1, stall_ms=0, item_us=0, nested=False):
        owner = torch.full((jobs, n), -1, dtype=torch.int32)
        count = torch.zeros(jobs, n, dtype=torch.int32)
        unfinished = torch.zeros(1, dtype=torch.int64)
        lib.pool_probe(n, grain, threads, jobs, stall_ms, item_us, int(nested), owner.data_ptr(), count.data_ptr(),
                       unfinished.data_ptr())
        return owner, count, int(unfinished)
    return run


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("n,grain", [(1, 1), (2, 1), (7, 3), (100, 1), (1000, 7), (70_000, 1)])
def test_every_item_runs_once_and_loops_run_in_order(probe, threads, n, grain):
    owner, count, unfinished = probe(n, grain, threads, jobs=3)
    assert torch.equal(count, torch.ones_like(count))
    assert unfinished == 0
    assert int(owner.min()) >= 0 and int(owner.max()) < threads
    # chunks of `grain` items run on one thread
    starts = owner[:, ::grain]
    assert torch.equal(owner, starts.repeat_interleave(grain, dim=1)[:, :n])


def test_a_loop_inside_a_loop_body_runs_serially_on_its_thread(probe):
    owner, count, unfinished = probe(64, 1, 2, jobs=2, nested=True)
    assert torch.equal(count, torch.ones_like(count)) and unfinished == 0


def test_a_descheduled_thread_holds_up_only_its_claimed_chunk(probe):
    if torch.get_num_threads() < 2:
        pytest.skip("needs two threads")
    # 128 items of 1 ms; the second thread sleeps 2 s in the first chunk it claims, long after the first thread
    # could have run every other item.
    owner, count, unfinished = probe(128, 1, 2, jobs=1, stall_ms=2000, item_us=1000)
    assert torch.equal(count, torch.ones_like(count)) and unfinished == 0
    by_worker = int((owner == 1).sum())
    # Had the shares been fixed (OpenMP's static schedule), the stalled thread would have run 64 items.
    assert by_worker == 1, f"the stalled thread ran {by_worker} items"
