"""The Ray cluster replicas run on: join one (`--ray-address`) or start a local one with token authentication
(`connect_ray`), tell when it went down (`RayCluster.down_reason`) and connect again (`reconnect`), and start the
replica actors on it (`launch_replicas`)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from pagedlm.config import EngineConfig, LoopConfig
from pagedlm.dp.actor import EngineReplica

PROBE_TIMEOUT_S = 2.0  # a joined cluster whose GCS does not accept a connection in this time is down


@dataclass
class RayCluster:
    """The Ray cluster replicas run on; `stop()` shuts Ray down if this process started it. `address`: the one
    joined (--ray-address), `probe`: the host:port that tells whether it is up (its GCS, or a Ray Client server)."""

    started: bool
    num_cpus: float
    cpus: list[int]  # this machine's cores (local cluster: replicas are pinned to slices of them)
    address: str | None = None
    probe: str | None = None

    def stop(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()

    def down_reason(self) -> str | None:
        """Why the cluster cannot serve: a local one this process started, its raylet or GCS process exited (e.g.
        killed, or the raylet followed its dashboard agent); a joined one, its GCS does not answer. None while it
        runs (and for a cluster this process neither started nor joined itself)."""
        if self.probe is not None:
            return None if _answers(self.probe) else f"the Ray cluster at {self.address} ({self.probe}) does not answer"
        import ray

        node = getattr(ray._private.worker, "_global_node", None) if self.started else None
        try:
            dead = [name for name, _ in node.dead_processes() if name in ("raylet", "gcs_server")] if node else []
        except Exception:  # noqa: BLE001 - Ray's internals moved: no verdict
            return None
        return f"Ray's {' and '.join(dead)} exited" if dead else None

    def disconnect(self) -> None:
        """Leave a Ray that went down (a driver left connected to a GCS that is gone is ended by Ray in a minute)."""
        import ray

        ray.shutdown()

    def reconnect(self, **init_kwargs: Any) -> None:
        """Connect again: a local cluster is started anew; a joined one is joined once its GCS answers
        (ConnectionError before: `ray.init` would wait on a cluster that is gone)."""
        if not self.started and not (_answers(self.probe) and _gcs_ready(self.probe, self.address)):
            raise ConnectionError(f"the Ray cluster at {self.address} ({self.probe}) is not back")
        self.disconnect()
        fresh = connect_ray(self.address if not self.started else None, **init_kwargs)
        self.num_cpus, self.cpus, self.probe = fresh.num_cpus, fresh.cpus, fresh.probe or self.probe


def _answers(address: str | None) -> bool:
    host, _, port = (address or "").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except (OSError, ValueError):
        return False
    return True


def _gcs_ready(probe: str | None, address: str | None) -> bool:
    """Whether the GCS at `probe` answers a request (a Ray Client address has no GCS to ask: its port answered)."""
    if (address or "").startswith("ray://"):
        return True
    try:
        from ray._raylet import GcsClient

        GcsClient(address=probe).internal_kv_get(b"pagedlm-probe", namespace=None, timeout=PROBE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - not up yet (or Ray's internals moved: ray.init decides)
        return False
    return True


def _probe_address(address: str) -> str | None:
    """What tells whether the joined cluster is up: a Ray Client server's host:port, else the GCS joined."""
    if address.startswith("ray://"):
        return address.removeprefix("ray://").split("/", 1)[0]
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001
        return address if ":" in address else None


RAY_MIN_VERSION = (2, 59)  # local clusters with token authentication (Ray turns it on by default from 2.59)


def connect_ray(address: str | None = None, num_cpus: int | None = None, **init_kwargs: Any) -> RayCluster:
    """Join the cluster at `address` (or the one already initialized); without one, start a local Ray on this
    machine's cores (no dashboard) with token authentication: Ray's services listen on every interface (it binds
    0.0.0.0 and turns a loopback node address into the routable one), so the token is what keeps others from
    running code in it. RuntimeError if this Ray cannot, or RAY_AUTH_MODE says otherwise."""
    import ray

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    started, probe = False, None
    if not ray.is_initialized():
        if address:
            ray.init(address=address, **init_kwargs)
            probe = _probe_address(address)
        else:
            _require_token_auth(ray.__version__)
            ray.init(address="local", num_cpus=num_cpus or len(cpus), include_dashboard=False, **init_kwargs)
            started = True
            if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":  # Ray sets it when it turns the token on
                ray.shutdown()
                raise RuntimeError("Ray started its local cluster without token authentication; refusing to use it.")
    total = float(ray.cluster_resources().get("CPU", len(cpus)))
    return RayCluster(started, total, cpus, address if probe else None, probe)


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
