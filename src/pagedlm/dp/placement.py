"""Replica placement: which replica of one model takes a request. Each policy is a small class with
`choose(request, candidates) -> Placement`; none sends a request to a replica whose free KV blocks cannot hold its
prompt while another replica's can.

`LeastLoadedPolicy`: the fewest outstanding requests, then the lowest KV usage. `RoundRobinPolicy`: replicas in
turn. `PrefixAffinityPolicy`: the replica that caches the longest prefix of the prompt, within a load slack.

Pure policy over `LoadStats` (what each replica exports): no engine here, so the model router (`router/`) balances
a model's replicas with the same policies.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class LoadStats:
    """Live numbers of one model replica (what the engine exports)."""

    queue_len: int = 0  # requests waiting to be scheduled
    running: int = 0  # requests being prefilled or decoded
    kv_usage: float = 0.0  # fraction of KV cache blocks in use
    ttft_s: float | None = None  # recent time to first token
    tpot_s: float | None = None  # recent time per output token
    healthy: bool = True
    replica: str | None = None
    free_blocks: int | None = None  # free KV blocks (None: unknown, assumed enough)
    block_size: int = 16
    prefix_blocks: int = 0  # leading blocks of this request's prompt the replica holds in its prefix cache

    @property
    def outstanding(self) -> int:
        return self.queue_len + self.running


class NoCandidateError(RuntimeError):
    """No model (or replica) can take the request (all excluded, down or overloaded past every fallback)."""


class PlacementRequest(Protocol):
    """What placement reads of a request (the router's `RequestFeatures` is one)."""

    @property
    def prompt_tokens(self) -> int: ...


class ReplicaCandidate(Protocol):
    """A replica a request may go to: a name (its model's, for the router) and its live load."""

    @property
    def name(self) -> str: ...

    @property
    def stats(self) -> LoadStats: ...


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica as a candidate of its own (a replica set's): its name and live load."""

    name: str
    stats: LoadStats


@dataclass(frozen=True)
class Placement:
    """A placement policy's choice: the candidate's name, its replica, and why."""

    model: str
    reason: str
    replica: str | None
    category: str = "load"


class ReplicaPolicy(Protocol):
    def choose(self, request: PlacementRequest | None, candidates: Sequence[ReplicaCandidate]) -> Placement: ...


def blocks_short(c: ReplicaCandidate, request: PlacementRequest | None) -> int:
    """KV blocks replica `c` lacks to hold the request's prompt (beyond its cached prefix) now; 0: it fits."""
    st = c.stats
    if st.free_blocks is None or request is None:
        return 0
    need = -(-(request.prompt_tokens + 1) // st.block_size) - st.prefix_blocks
    return max(0, need - st.free_blocks)


def _usable(candidates: Sequence[ReplicaCandidate], request: PlacementRequest | None,
            max_kv_usage: float) -> list[ReplicaCandidate]:
    """The healthy replicas that fit the request and are below `max_kv_usage`; failing that, those that fit;
    failing that (none fits now: the request will wait), every healthy one."""
    healthy = [c for c in candidates if c.stats.healthy]
    if not healthy:
        raise NoCandidateError("no healthy replica")
    fit = [c for c in healthy if blocks_short(c, request) == 0]
    return [c for c in fit if c.stats.kv_usage < max_kv_usage] or fit or healthy


def _load_key(c: ReplicaCandidate) -> tuple:
    return c.stats.outstanding, c.stats.kv_usage, c.stats.replica or ""


class LeastLoadedPolicy:
    """Among replicas of one model: the healthy one with the fewest outstanding requests, then the lowest KV
    usage; replicas that cannot fit the prompt, or at or above `max_kv_usage`, only when every healthy one is
    so."""

    def __init__(self, max_kv_usage: float = 0.95) -> None:
        self.max_kv_usage = max_kv_usage

    def choose(self, request: PlacementRequest | None, candidates: Sequence[ReplicaCandidate]) -> Placement:
        c = min(_usable(candidates, request, self.max_kv_usage), key=_load_key)
        return Placement(c.name, f"least loaded replica ({c.stats.outstanding} outstanding, "
                                 f"kv {c.stats.kv_usage:.0%})", c.stats.replica)


class RoundRobinPolicy:
    """Replicas in turn (by name), skipping those that are down or cannot fit the prompt while others can."""

    def __init__(self, max_kv_usage: float = 0.95) -> None:
        self.max_kv_usage = max_kv_usage
        self._last: str = ""

    def choose(self, request: PlacementRequest | None, candidates: Sequence[ReplicaCandidate]) -> Placement:
        usable = sorted(_usable(candidates, request, self.max_kv_usage), key=lambda c: c.stats.replica or "")
        c = next((c for c in usable if (c.stats.replica or "") > self._last), usable[0])
        self._last = c.stats.replica or ""
        return Placement(c.name, "round robin", c.stats.replica)


class PrefixAffinityPolicy:
    """The replica whose prefix cache holds the longest prefix of the prompt (`LoadStats.prefix_blocks`, from
    the block hashes each replica publishes), unless it has more than `max_imbalance` outstanding requests
    beyond the least loaded one; then, or without any cached prefix, the least loaded replica. Replicas that
    cannot fit the prompt are skipped while others can (SGLang's cache-aware routing, with exact hashes)."""

    def __init__(self, max_kv_usage: float = 0.95, max_imbalance: int = 8) -> None:
        self.max_kv_usage, self.max_imbalance = max_kv_usage, max_imbalance

    def choose(self, request: PlacementRequest | None, candidates: Sequence[ReplicaCandidate]) -> Placement:
        usable = _usable(candidates, request, self.max_kv_usage)
        least = min(usable, key=_load_key)
        best = max(c.stats.prefix_blocks for c in usable)
        if best > 0:
            c = min((c for c in usable if c.stats.prefix_blocks == best), key=_load_key)
            if c.stats.outstanding - least.stats.outstanding <= self.max_imbalance:
                return Placement(c.name, f"prefix affinity ({best} blocks cached, {c.stats.outstanding} "
                                         "outstanding)", c.stats.replica)
            why = f"prefix holder {c.stats.replica} busier by {c.stats.outstanding - least.stats.outstanding}"
        else:
            why = "no cached prefix"
        return Placement(least.name, f"least loaded replica ({why}; {least.stats.outstanding} outstanding)",
                         least.stats.replica)


REPLICA_POLICIES = {"prefix": PrefixAffinityPolicy, "least-loaded": LeastLoadedPolicy,
                    "round-robin": RoundRobinPolicy}
