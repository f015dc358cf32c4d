"""Data parallelism: how many engine replicas serve each model, on which Ray cluster, and how requests are spread
over them (`ParallelConfig`, vLLM's name)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.config.flags import check_choices, option

REPLICAS = "replicas (data parallelism on Ray)"  # the flags' help group
REPLICA_POLICIES = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class ParallelConfig:
    """Replica settings, each a `pagedlm serve` flag of the same name (`LLM` takes the first three too)."""

    data_parallel_size: int = option(1, "engine replicas per model, each a Ray actor on its share of the cores (1: "
                                     "the engine runs in this process)", aliases=("-dp",), group=REPLICAS)
    ray_address: str | None = option(None, "join this Ray cluster (e.g. ray://head:10001 or auto) instead of "
                                     "starting a local one; while it does not answer /health is 503, and it is "
                                     "joined again once it is back", group=REPLICAS)
    replica_policy: str = option("prefix", "how requests are spread over replicas (prefix: the replica caching the "
                                 "longest prefix of the prompt, unless much busier)", choices=REPLICA_POLICIES,
                                 group=REPLICAS)
    threads_per_replica: int | None = option(None, "torch threads (and CPUs reserved) per replica (default: the "
                                             "cluster's CPUs / replicas)", group=REPLICAS)
    replica_health_timeout: float = option(10.0, "a replica that does not answer a poll for this many seconds is "
                                           "taken out and restarted", group=REPLICAS)

    def __post_init__(self) -> None:
        check_choices(self)
        if self.data_parallel_size < 1 or (self.threads_per_replica is not None and self.threads_per_replica < 1):
            raise ValueError("--data-parallel-size and --threads-per-replica must be >= 1.")

    @property
    def replicated(self) -> bool:
        """The engines run as Ray actors (several replicas, or a cluster to join)."""
        return self.data_parallel_size > 1 or self.ray_address is not None
