"""Start a replica set on Ray: join the cluster at `parallel.ray_address` (or start a local one), launch
`parallel.data_parallel_size` replica actors and their clients, and, on a local Ray of its own, watch it
(`RayWatch`): if Ray's raylet or GCS dies, every replica goes with it, so Ray and the replicas are started again."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pagedlm.config import EngineConfig, LoopConfig, ParallelConfig
from pagedlm.dp.client import ReplicaClient
from pagedlm.dp.cluster import RayCluster, connect_ray, launch_replicas
from pagedlm.dp.replica_set import ReplicaSet

logger = logging.getLogger(__name__)

StartReplicas = Callable[..., list[ReplicaClient]]  # (cluster, tokenizer=None) -> the replicas' clients


def launch_replica_set(engine: EngineConfig, parallel: ParallelConfig, loop: LoopConfig | None = None,
                       ray_init_kwargs: dict | None = None) -> ReplicaSet:
    """Start (or join, with `parallel.ray_address`) Ray, `parallel.data_parallel_size` actors of `engine` and
    their clients, as one `ReplicaSet`; its `shutdown` kills the actors and stops a Ray it started."""
    import ray

    init_kwargs = ray_init_kwargs or {}

    def start(cluster: RayCluster, tokenizer=None) -> list[ReplicaClient]:
        actors = []
        try:
            actors = launch_replicas(cluster, engine, parallel.data_parallel_size,
                                     num_threads=parallel.threads_per_replica, loop=loop)
            clients: list[ReplicaClient] = []
            for i, actor in enumerate(actors):
                clients.append(ReplicaClient(actor, f"{i}", tokenizer or (clients[0].tokenizer if clients else None),
                                             loop=loop, health_timeout=parallel.replica_health_timeout))
                logger.info("Replica %d: pid %d on node %s, %d threads", i, clients[-1].pid,
                            clients[-1].info.node[:12], clients[-1].info.num_threads)
            return clients
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            cluster.stop()
            raise

    cluster = connect_ray(parallel.ray_address, **init_kwargs)
    rs: ReplicaSet

    def stop() -> None:
        for c in rs.replicas.values():
            try:
                ray.kill(c.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        cluster.stop()

    rs = ReplicaSet(start(cluster), parallel.replica_policy, on_shutdown=stop)
    if cluster.started:
        rs.watch = RayWatch(rs, cluster, start, init_kwargs)
    return rs


class RayWatch:
    """A thread while a set's own local Ray runs: if Ray's raylet or GCS dies, restart Ray and the replicas (the
    set answers `down_reason` meanwhile; requests fail over to nothing and get 503)."""

    WATCH_S = 1.0  # how often it checks that Ray's processes run

    def __init__(self, rs: ReplicaSet, cluster: RayCluster, start: StartReplicas, init_kwargs: dict) -> None:
        self.rs, self.cluster, self.start, self.init_kwargs = rs, cluster, start, init_kwargs
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedlm-ray-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop watching; a restart under way ends first."""
        self._closed.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        rs, cluster = self.rs, self.cluster
        while not self._closed.wait(self.WATCH_S):
            why = cluster.down_reason()
            if why is None:
                continue
            rs.ray_down = f"{why}; restarting Ray and the replicas"
            logger.error("The local Ray cluster is down (%s): every replica went with it. Restarting Ray and "
                         "the %d replicas", why, len(rs.replicas))
            old = list(rs.replicas.values())
            for c in old:
                c.shutdown(timeout=5.0, remote=False)  # its open requests fail (EngineDeadError); its actor is gone
            self._restart(old)

    def _restart(self, old: list[ReplicaClient]) -> None:
        import ray

        rs, cluster, delay = self.rs, self.cluster, 1.0
        while not self._closed.is_set():
            try:
                ray.shutdown()
                fresh = connect_ray(None, **self.init_kwargs)
                cluster.num_cpus, cluster.cpus = fresh.num_cpus, fresh.cpus
                clients = self.start(cluster, old[0].tokenizer)
            except Exception:  # noqa: BLE001 - try again
                logger.exception("Restarting Ray failed; trying again in %.0f s", delay)
                self._closed.wait(delay)
                delay = min(2 * delay, 30.0)
                continue
            for new, prev in zip(clients, old):
                new.carry_over(prev)
            rs.adopt(clients)
            rs.ray_down = None
            logger.warning("Ray and its %d replicas are back", len(clients))
            return
