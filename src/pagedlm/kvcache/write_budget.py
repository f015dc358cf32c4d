"""How much of the machine the disk tier's write-behind may take: a token bucket of CPU seconds.

The bucket fills at `share` CPU seconds per second of wall time, up to `share * burst_seconds`; it starts full.
A run of blocks is admitted while the bucket is positive, and is charged its predicted cost (its bytes at the
measured CPU cost per byte) before the engine copies it out; once written, the charge is settled against what it
really cost (the copy on the engine thread and the writer thread's CPU time). A run that is not admitted is not
copied or written: its blocks stay in the in-memory prefix cache only. So a busy server spends about `share` of a
core on writing, and a quiet one (or a burst after a quiet period) writes everything.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

BURST_SECONDS = 300.0  # the bucket holds this many seconds of refill
_COST_EMA = 0.3  # weight of the newest measured cost per byte
_FIRST_COST_PER_BYTE = 4e-9  # s/byte until measured (250 MB/s of copying, checksumming and writing)


class WriteBudget:
    """Thread-safe: `take` on the engine thread, `settle` on the writer thread."""

    def __init__(self, share: float, burst_seconds: float = BURST_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.capacity = share * burst_seconds
        self.clock = clock
        self.cost_per_byte = _FIRST_COST_PER_BYTE
        self.level = self.capacity
        self._last = clock()
        self._lock = threading.Lock()

    @property
    def unlimited(self) -> bool:
        return self.share >= 1.0

    def take(self, nbytes: int) -> float | None:
        """Admit a run of `nbytes`: its predicted cost, now charged; None (not admitted) when the bucket is empty."""
        if self.unlimited:
            return 0.0
        with self._lock:
            now = self.clock()
            self.level = min(self.capacity, self.level + self.share * (now - self._last))
            self._last = now
            if self.level <= 0:
                return None
            charge = nbytes * self.cost_per_byte
            self.level -= charge
            return charge

    def settle(self, nbytes: int, charged: float, seconds: float) -> None:
        """A run admitted with `charged` cost `seconds` of CPU in all: the difference goes to the bucket."""
        if self.unlimited or nbytes <= 0:
            return
        with self._lock:
            self.level += charged - seconds
            self.cost_per_byte = (1 - _COST_EMA) * self.cost_per_byte + _COST_EMA * seconds / nbytes
