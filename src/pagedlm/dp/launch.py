"""Start a replica set on Ray: join the cluster at `parallel.ray_address` (or start a local one), launch
`parallel.data_parallel_size` replica actors and their clients, and watch that Ray (`RayWatch`, one per process,
every replica set on it): if a local Ray's raylet or GCS dies, or a joined cluster stops answering, every replica
goes with it, so the watch starts Ray again (or joins the cluster again once it is back) and the replicas with it."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedlm.config import EngineConfig, LoopConfig, ParallelConfig
from pagedlm.dp.client import ReplicaClient
from pagedlm.dp.cluster import RayCluster, connect_ray, launch_replicas
from pagedlm.dp.replica_set import ReplicaSet

logger = logging.getLogger(__name__)

StartReplicas = Callable[..., list[ReplicaClient]]  # (cluster, tokenizer=None) -> the replicas' clients


def launch_replica_set(engine: EngineConfig, parallel: ParallelConfig, loop: LoopConfig | None = None,
                       ray_init_kwargs: dict | None = None) -> ReplicaSet:
    """Start (or join, with `parallel.ray_address`) Ray, `parallel.data_parallel_size` actors of `engine` and
    their clients, as one `ReplicaSet`, watched by the process's `RayWatch`; its `shutdown` kills the actors and
    stops a Ray it started."""
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
    RayWatch.of(cluster, init_kwargs).add(rs, cluster, start)
    return rs


@dataclass
class Watched:
    """A replica set on the watched Ray: its cluster (as it connected) and how its replicas start."""

    watch: RayWatch
    rs: ReplicaSet
    cluster: RayCluster
    start: StartReplicas
    old: list[ReplicaClient] = field(default_factory=list)  # its replicas when Ray went down

    def stop(self, timeout: float) -> None:
        """The set stops: no longer watched (the watch's thread ends with its last set; a restart under way
        ends first)."""
        self.watch.remove(self, timeout)


class RayWatch:
    """A thread while replica sets run on this process's Ray (`cluster`: the connection it made, which knows how
    to make it again). When Ray is down (RayCluster.down_reason), every set says why (`ray_down`: /health's 503),
    its replicas' requests fail, and the watch leaves Ray, then tries every RETRY_S (doubling up to MAX_RETRY_S)
    to start it again (a local Ray) or to join it again once it answers (a joined cluster), and the replicas."""

    WATCH_S = 1.0  # how often it checks that Ray is up
    RETRY_S, MAX_RETRY_S = 1.0, 10.0  # the first wait between tries to bring Ray back, and the longest
    current: RayWatch | None = None  # the process's (one Ray per process)
    _current_lock = threading.Lock()

    @classmethod
    def of(cls, cluster: RayCluster, init_kwargs: dict) -> RayWatch:
        """The process's watch: a new one for a Ray this process started or joined, else the one watching it."""
        with cls._current_lock:
            current = cls.current
            if current is None or current.closed.is_set() or (
                    current.cluster is not cluster and (cluster.started or cluster.probe is not None)):
                if cls.current is not None:
                    cls.current.close(5.0)
                cls.current = cls(cluster, init_kwargs)
            return cls.current

    def __init__(self, cluster: RayCluster, init_kwargs: dict) -> None:
        self.cluster, self.init_kwargs = cluster, init_kwargs
        self.sets: list[Watched] = []
        self._lock = threading.Lock()
        self.closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedlm-ray-watch", daemon=True)
        self._thread.start()

    def add(self, rs: ReplicaSet, cluster: RayCluster, start: StartReplicas) -> None:
        rs.watch = w = Watched(self, rs, cluster, start)
        with self._lock:
            self.sets.append(w)

    def remove(self, w: Watched, timeout: float) -> None:
        with self._lock:
            if w in self.sets:
                self.sets.remove(w)
            last = not self.sets
        if last:
            self.close(timeout)

    def close(self, timeout: float) -> None:
        self.closed.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self.closed.wait(self.WATCH_S):
            why = self.cluster.down_reason()
            if why is not None and not self.closed.is_set():
                self._down(why)
                self._bring_back()

    def _down(self, why: str) -> None:
        what = ("restarting Ray and the replicas" if self.cluster.started else
                "joining it again, and starting the replicas, once it answers")
        with self._lock:
            sets = list(self.sets)
        for w in sets:
            w.rs.ray_down = f"{why}; {what}"
            w.old = list(w.rs.replicas.values())
            logger.error("Ray is down (%s): the %d replicas went with it; %s", why, len(w.old), what)
            for c in w.old:
                c.shutdown(timeout=5.0, remote=False)  # its open requests fail (EngineDeadError); its actor is gone
        self.cluster.disconnect()

    def _bring_back(self) -> None:
        delay = self.RETRY_S
        while not self.closed.is_set():
            with self._lock:
                sets = list(self.sets)
            try:
                self.cluster.reconnect(**self.init_kwargs)
                fresh = []
                for w in sets:
                    if w.cluster is not self.cluster:  # another set on the same Ray: its share of the new one
                        w.cluster.num_cpus, w.cluster.cpus = self.cluster.num_cpus, self.cluster.cpus
                    fresh.append(w.start(w.cluster, w.old[0].tokenizer))
            except ConnectionError as e:
                logger.warning("%s; trying again in %.0f s", e, delay)
            except Exception:  # noqa: BLE001 - try again
                logger.exception("Bringing Ray and the replicas back failed; trying again in %.0f s", delay)
                self.cluster.disconnect()  # the replicas started so far go with this connection
            else:
                for w, clients in zip(sets, fresh):
                    for new, prev in zip(clients, w.old):
                        new.carry_over(prev)
                    w.rs.adopt(clients)
                    w.rs.ray_down = None
                    logger.warning("Ray and the %d replicas are back", len(clients))
                return
            self.closed.wait(delay)
            delay = min(2 * delay, self.MAX_RETRY_S)
