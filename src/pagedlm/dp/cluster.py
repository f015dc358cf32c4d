"""The Ray cluster replicas run on: join one (`--ray-address`) or start a local one with token authentication
(`connect_ray`), tell when a local one went down (`RayCluster.down_reason`), and start the replica actors on it
(`launch_replicas`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pagedlm.config import EngineConfig, LoopConfig
from pagedlm.dp.actor import EngineReplica


@dataclass
class RayCluster:
    """The Ray cluster replicas run on; `stop()` shuts Ray down if this process started it."""

    started: bool
    num_cpus: float
    cpus: list[int]  # this machine's cores (local cluster: replicas are pinned to slices of them)

    def stop(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()

    def down_reason(self) -> str | None:
        """Why a local cluster this process started cannot serve: its raylet or GCS process exited (e.g. killed,
        or the raylet followed its dashboard agent); None while they run, or for a cluster joined."""
        import ray

        node = getattr(ray._private.worker, "_global_node", None) if self.started else None
        try:
            dead = [name for name, _ in node.dead_processes() if name in ("raylet", "gcs_server")] if node else []
        except Exception:  # noqa: BLE001 - Ray's internals moved: no verdict
            return None
        return f"Ray's {' and '.join(dead)} exited" if dead else None


RAY_MIN_VERSION = (2, 59)  # local clusters with token authentication (Ray turns it on by default from 2.59)


def connect_ray(address: str | None = None, num_cpus: int | None = None, **init_kwargs: Any) -> RayCluster:
    """Join the cluster at `address` (or the one already initialized); without one, start a local Ray on this
    machine's cores (no dashboard) with token authentication: Ray's services listen on every interface (it binds
    0.0.0.0 and turns a loopback node address into the routable one), so the token is what keeps others from
    running code in it. RuntimeError if this Ray cannot, or RAY_AUTH_MODE says otherwise."""
    import ray

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    started = False
    if not ray.is_initialized():
        if address:
            ray.init(address=address, **init_kwargs)
        else:
            _require_token_auth(ray.__version__)
            ray.init(address="local", num_cpus=num_cpus or len(cpus), include_dashboard=False, **init_kwargs)
            started = True
            if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":  # Ray sets it when it turns the token on
                ray.shutdown()
                raise RuntimeError("Ray started its local cluster without token authentication; refusing to use it.")
    total = float(ray.cluster_resources().get("CPU", len(cpus)))
    return RayCluster(started, total, cpus)


def _require_token_auth(version: str) -> None:
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < RAY_MIN_VERSION:
        raise RuntimeError(f"Ray {version} starts local clusters without authentication; install ray>="
                           f"{'.'.join(map(str, RAY_MIN_VERSION))} (pip install 'pagedlm[ray]') or join a cluster "
                           "of your own with --ray-address.")
    mode = os.environ.get("RAY_AUTH_MODE", "token")  # unset: Ray's default for a local cluster (>= 2.59)
    if mode.lower() != "token":
        raise RuntimeError(f"RAY_AUTH_MODE={mode}: the local Ray cluster would listen on every interface without "
                           "authentication, running code for anyone who reaches it. Unset it (token authentication "
                           "is then on), or start a cluster yourself and join it with --ray-address.")


def launch_replicas(cluster: RayCluster, config: EngineConfig, num_replicas: int, *,
                    num_threads: int | None = None, loop: LoopConfig | None = None,
                    max_restarts: int = -1) -> list[Any]:
    """Start `num_replicas` `EngineReplica` actors, each reserving `num_threads` CPUs (default: its share of
    the cluster's) and running torch on that many threads; on a local cluster each is pinned to its own cores.
    Ray restarts an actor whose process dies (`max_restarts`, -1: always)."""
    import ray

    if num_replicas < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}.")
    share = cluster.num_cpus / num_replicas
    threads = num_threads or max(1, int(share))
    actor_cls = ray.remote(EngineReplica)
    actors = []
    for i in range(num_replicas):
        cores = None
        if cluster.started and threads * num_replicas <= len(cluster.cpus):
            cores = cluster.cpus[i * threads:(i + 1) * threads]
        actors.append(actor_cls.options(
            num_cpus=min(threads, share), max_restarts=max_restarts, max_task_retries=0, max_concurrency=10_000,
        ).remote(config, threads, cores, loop))
    return actors
