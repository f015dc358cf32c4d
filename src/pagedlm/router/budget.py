"""Spend caps that bind: `--max-cost-per-hour` overall and per API key.

A `SpendLedger` counts what requests cost in the last `window_s` seconds, by the tokens they actually used at
their model's prices, plus a hold for every request in flight at its most expensive outcome (its prompt bound and
max_tokens at the chosen model's prices): a burst routed before anything finished cannot overshoot the cap. When
a request settles, its hold becomes its real cost. Thread-safe (holds are taken on the router thread, settled on
the engines' threads).
"""
from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetLimits:
    max_cost_per_hour: float | None = None  # all requests
    max_cost_per_hour_per_key: float | None = None  # each API key
    near: float = 0.8  # share of a cap from which requests go to cheaper models
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("max_cost_per_hour", "max_cost_per_hour_per_key"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if not 0.0 < self.near <= 1.0 or not self.window_s > 0:
            raise ValueError(f"need 0 < near <= 1 and window_s > 0, got {self.near}, {self.window_s}")

    @property
    def active(self) -> bool:
        return self.max_cost_per_hour is not None or self.max_cost_per_hour_per_key is not None


class BudgetExceededError(RuntimeError):
    """Even the cheapest model would take spend past a cap; `retry_after_s`: when enough spend ages out."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class BudgetState:
    cap_per_hour: float | None
    spent: float  # settled cost in the window
    held: float  # holds of requests in flight
    total_spent: float  # settled cost since start

    @property
    def committed(self) -> float:
        return self.spent + self.held


def tenant(api_key: str | None) -> str | None:
    """The ledger's name for an API key (never the key itself)."""
    return None if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()[:16]


class SpendLedger:
    def __init__(self, limits: BudgetLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._spent: deque[tuple[float, str | None, float]] = deque()  # (time, tenant, cost)
        self._holds: dict[int, tuple[str | None, float, float]] = {}  # id -> (tenant, cost, since)
        self._ids = itertools.count(1)
        self._total = 0.0
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        """Forget spend older than the window, and holds never settled within it (a request lost on the way)."""
        while self._spent and self._spent[0][0] <= now - self.limits.window_s:
            self._spent.popleft()
        for hid in [h for h, (_, _, t) in self._holds.items() if t <= now - self.limits.window_s]:
            del self._holds[hid]

    def _committed(self, who: str | None) -> tuple[float, float]:
        """(all, this tenant's) settled spend in the window plus holds; lock held."""
        spent_all = sum(c for _, _, c in self._spent) + sum(c for _, c, _ in self._holds.values())
        if who is None:
            return spent_all, 0.0
        mine = sum(c for _, k, c in self._spent if k == who) + sum(c for k, c, _ in self._holds.values() if k == who)
        return spent_all, mine

    def _caps(self, who: str | None) -> list[tuple[str, float, int]]:
        """(name, cap, index into _committed's pair) for each cap that applies."""
        caps = []
        if self.limits.max_cost_per_hour is not None:
            caps.append(("server", self.limits.max_cost_per_hour, 0))
        if who is not None and self.limits.max_cost_per_hour_per_key is not None:
            caps.append(("API key", self.limits.max_cost_per_hour_per_key, 1))
        return caps

    def check(self, api_key: str | None, cost: float) -> tuple[str, str]:
        """("ok" | "near" | "over", why) for adding a request of `cost` now."""
        who = tenant(api_key)
        with self._lock:
            self._expire(self.clock())
            committed = self._committed(who)
        status, why = "ok", ""
        for name, cap, i in self._caps(who):
            after = committed[i] + cost
            if after > cap * (1 + 1e-9):
                return "over", f"{name} spend would reach ${after:.4g} of ${cap:.4g}/h"
            if after > self.limits.near * cap:
                status, why = "near", f"{name} spend ${after:.4g} of ${cap:.4g}/h (over {self.limits.near:.0%})"
        return status, why

    def retry_after(self, api_key: str | None, cost: float) -> float:
        """Seconds until `cost` fits under every cap, if nothing else is spent meanwhile."""
        who = tenant(api_key)
        with self._lock:
            now = self.clock()
            self._expire(now)
            committed = list(self._committed(who))
            wait = 0.0
            for name, cap, i in self._caps(who):
                excess = committed[i] + cost - cap
                for t, k, c in self._spent:
                    if excess <= 0:
                        break
                    if i == 0 or k == who:
                        excess -= c
                        wait = max(wait, t + self.limits.window_s - now)
        return max(1.0, wait)

    def hold(self, api_key: str | None, cost: float) -> int:
        with self._lock:
            hid = next(self._ids)
            self._holds[hid] = (tenant(api_key), cost, self.clock())
            return hid

    def release(self, hold_id: int | None) -> None:
        with self._lock:
            self._holds.pop(hold_id, None)

    def settle(self, hold_id: int | None, cost: float) -> None:
        """Replace the hold with the request's real cost (charged now). Unknown holds are ignored."""
        with self._lock:
            held = self._holds.pop(hold_id, None)
            if held is None:
                return
            self._spent.append((self.clock(), held[0], cost))
            self._total += cost

    def state(self, api_key: str | None = None) -> BudgetState:
        who = tenant(api_key)
        with self._lock:
            self._expire(self.clock())
            spent = sum(c for _, k, c in self._spent if who is None or k == who)
            held = sum(c for k, c, _ in self._holds.values() if who is None or k == who)
            cap = self.limits.max_cost_per_hour if who is None else self.limits.max_cost_per_hour_per_key
            return BudgetState(cap, spent, held, self._total)
