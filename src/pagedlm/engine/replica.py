"""Engine replicas in other processes (Ray actors), behind the same async interface as `AsyncLLMEngine`.

`EngineReplica` is the actor body: an `AsyncLLMEngine` on its share of the cores, answering `add` / `abort` /
`poll`. `add` takes the `EngineRequest` the front end checked; `poll` is a long poll: it returns, for every open
request with something new, its `EngineOutput` deltas since the last poll merged into one (the engine contract
of protocol.py, as in process) or its error as a `WireError`, plus the step records (latencies, finished requests)
for the metrics, the engine's stats, and the prefix-cache changes (KV events: 8-byte prefixes of the chained block
hashes stored or removed since the last poll). One poll per replica, not one call per token.

`ReplicaClient` is the front end's proxy of one actor: `submit` returns a stream with `RequestStream`'s
contract (accepted / async iteration / abort / unread_since), a pump thread long-polls the actor and delivers
outputs to the caller's event loop, and the same thread checks health: a replica whose process died, or whose
poll does not answer within `health_timeout`, is taken out (its open streams are handed to `on_lost`, or failed
with EngineDeadError), killed if it hung, and back once Ray restarted it (`restarts` counts it).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedlm.config import EngineConfig, LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.client import EngineClient, RequestStream, StepRecord, deliver
from pagedlm.engine.errors import EngineDeadError, WireError, as_engine_error, stalled_error
from pagedlm.engine.input_processor import EngineInfo, InputProcessor
from pagedlm.engine.llm_engine import EngineStats
from pagedlm.engine.protocol import EngineOutput, EngineRequest, merge_outputs
from pagedlm.engine.snapshot import EngineSnapshot
from pagedlm.kvcache.block_manager import hash_block

logger = logging.getLogger(__name__)

HASH_BYTES = 8  # published prefix of each sha256 block hash: collisions only mislead routing, never results


def short_hash(h: bytes) -> int:
    return int.from_bytes(h[:HASH_BYTES], "little")


def prompt_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Short chain hashes of the prompt's blocks that the prefix cache can serve (every full block before the
    last token, as `BlockManager.find_cached_prefix` looks them up)."""
    out, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], cache_salt)
        out.append(short_hash(parent))
    return out


@dataclass
class ReplicaInfo:
    """A replica's engine facts (its front end's `InputProcessor` is built from them) and where it runs."""

    engine: EngineInfo
    stats: EngineStats
    pid: int
    node: str
    num_threads: int


@dataclass
class ReplicaPoll:
    outputs: dict[str, EngineOutput | WireError]  # what is new of each request since the last poll, or its error
    record: StepRecord  # merged step records since the last poll (its stats: the newest)
    counters: tuple[int, int, int]  # rejected, failed, stalled
    running: bool
    cache_snapshot: list[int] | None = None  # the whole published set (first poll, or after a resync)
    cache_stored: list[int] = field(default_factory=list)
    cache_removed: list[int] = field(default_factory=list)


class EngineReplica:
    """The actor body (also usable in-process): one `AsyncLLMEngine` on `num_threads` torch threads, optionally
    pinned to `cpus`. Its methods are coroutines: Ray runs them concurrently on the actor's event loop."""

    MAX_EVENTS = 1 << 16  # undrained KV events beyond this: the next poll sends a snapshot instead

    def __init__(self, config: EngineConfig, num_threads: int | None = None, cpus: list[int] | None = None,
                 loop: LoopConfig | None = None) -> None:
        import torch

        from pagedlm.engine.llm_engine import LLMEngine

        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        if num_threads:
            torch.set_num_threads(num_threads)
        engine = LLMEngine(config)
        self.engine = AsyncLLMEngine(engine, loop or LoopConfig.offline())
        self._streams: dict[str, RequestStream] = {}
        self._ready: dict[str, list[EngineOutput] | WireError] = {}
        self._records: list[StepRecord] = []
        self._records_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot_due = True
        self._pool = engine.block_manager.gpu
        self._pool.events = [] if engine.block_manager.enable_prefix_caching else None
        self.engine.add_listener(self._on_step)

    def _on_step(self, rec: StepRecord) -> None:  # engine thread
        if rec.ttft or rec.itl or rec.finished:
            with self._records_lock:
                self._records.append(rec)

    async def info(self) -> ReplicaInfo:
        try:
            import ray
            node = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - not in Ray
            node = "local"
        import torch
        info = self.engine.input_processor.info
        return ReplicaInfo(info, self.engine.stats, os.getpid(), node, torch.get_num_threads())

    async def add(self, request: EngineRequest, age_s: float) -> WireError | None:
        """Queue a request (checked by the front end; its constraint is compiled here, off the engine thread);
        None, or the refusal. `age_s`: time since its arrival."""
        self._bind_loop()
        request.arrival_time = time.monotonic() - max(age_s, 0.0)
        try:
            await asyncio.to_thread(self.engine.input_processor.prepare_params, request.params)
            stream = self.engine.submit(request)
            await stream.accepted()
        except Exception as e:  # noqa: BLE001 - the verdict goes back to the caller
            return as_engine_error(e, request.request_id).to_wire()
        self._streams[request.request_id] = stream
        asyncio.ensure_future(self._forward(stream))
        return None

    async def _forward(self, stream: RequestStream) -> None:
        rid = stream.request_id
        try:
            async for out in stream:
                pending = self._ready.setdefault(rid, [])
                if isinstance(pending, list):
                    pending.append(out)
                self._wake.set()
        except Exception as e:  # noqa: BLE001
            self._ready[rid] = as_engine_error(e, rid).to_wire()
            self._wake.set()
        finally:
            self._streams.pop(rid, None)

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.abort()
            self._ready.pop(rid, None)

    async def fail_all(self, message: str) -> None:
        self.engine.fail_all(message)

    async def poll(self, timeout: float) -> ReplicaPoll:
        """Wait up to `timeout` s for new outputs; return them with the latest stats, records and KV events."""
        self._bind_loop()
        if not self._ready:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        ready, self._ready = self._ready, {}
        outputs = {rid: items if isinstance(items, WireError) else merge_outputs(items) for rid, items in ready.items()}
        with self._records_lock:
            records, self._records = self._records, []
        record = StepRecord(self.engine.stats)
        for r in records:
            record.ttft += r.ttft
            record.itl += r.itl
            record.finished += r.finished
        e = self.engine
        poll = ReplicaPoll(outputs, record, (e.num_rejected, e.num_failed, e.num_stalled), e.is_running)
        self._publish(poll)
        return poll

    def _publish(self, poll: ReplicaPoll) -> None:
        pool = self._pool
        if pool.events is None:
            return
        # the engine thread appends events while we read: swap the list, then read the old one
        events = pool.drain_events()
        if self._snapshot_due or len(events) > self.MAX_EVENTS:
            self._snapshot_due = False
            poll.cache_snapshot = [short_hash(h) for h in list(pool.cached)]
            return
        for stored, h in events:
            (poll.cache_stored if stored else poll.cache_removed).append(short_hash(h))

    async def resync(self) -> None:
        """The next poll sends the whole published cache state (a new client)."""
        self._snapshot_due = True

    async def ping(self) -> int:
        return os.getpid()

    async def snapshot(self, show_text: bool = False) -> EngineSnapshot:
        return await self.engine.snapshot(show_text)

    async def shutdown(self) -> None:
        self.engine.shutdown()

    def _bind_loop(self) -> None:
        if self._wake is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()


class RemoteStream(RequestStream):
    """A request's outputs from a replica; `RequestStream`'s contract. `taken` counts outputs the consumer took;
    `buffered` (set by a consumer that sends nothing before the end) lets a replica set retry it elsewhere even
    after outputs were taken (`restart`). `client` is the replica that runs it now (None before it is placed)."""

    def __init__(self, owner: Any, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(owner, request_id, loop)
        self.client: ReplicaClient | None = None
        self.taken = 0
        self.attempts = 0
        self.placement: Any = None  # what a replica set needs to place it again

    async def __anext__(self) -> EngineOutput:
        out = await super().__anext__()
        self.taken += 1
        return out

    next_latest = __anext__

    @property
    def retryable(self) -> bool:
        return self.taken == 0 or self.buffered

    def _release(self) -> None:
        if self.client is not None:
            self.client.abort(self.request_id)


class ReplicaClient(EngineClient):
    """One replica actor seen as an engine (an `EngineClient`, as `AsyncLLMEngine` is).

    on_lost(stream, error): called (on the pump thread) for each open stream of a replica that died or hung;
    default: the stream fails with `error`.
    """

    EXPECT_S = 5.0
    MAX_EXPECTED = 1 << 16

    def __init__(self, actor: Any, name: str, tokenizer: Any = None, *, loop: LoopConfig | None = None,
                 poll_timeout: float = 0.5, health_timeout: float = 10.0,
                 on_lost: Callable[[RemoteStream, BaseException], None] | None = None) -> None:
        import ray

        self._ray = ray
        self.actor, self.name = actor, name
        self.info: ReplicaInfo = ray.get(actor.info.remote())
        if tokenizer is None:
            from pagedlm.hub.registry import resolve_model
            from pagedlm.hub.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(resolve_model(self.info.engine.model))
        self.input_processor = InputProcessor(self.info.engine, tokenizer)
        loop = loop or LoopConfig.offline()
        self.max_waiting, self.stall_timeout = loop.max_waiting, loop.stream_stall_timeout
        self.poll_timeout, self.health_timeout = poll_timeout, health_timeout
        self.on_lost = on_lost
        self.stats: EngineStats = self.info.stats
        self.num_rejected = self.num_failed = self.num_stalled = 0
        self._base = (0, 0, 0)  # counters of earlier incarnations (a restart starts from zero)
        self.restarts = 0
        self.healthy = True
        self.cached: set[int] = set()  # published prefix-cache block hashes
        self._expected: dict[int, float] = {}  # hashes of prompts sent since, until when (insertion-ordered)
        self.pid = self.info.pid
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._streams: dict[str, RemoteStream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name=f"pagedlm-replica-{name}", daemon=True)
        self._thread.start()

    # --- the engine interface (listeners run on the pump thread, after each poll that brought records) ------
    @property
    def is_running(self) -> bool:
        return self.healthy and not self._stop.is_set()

    def submit(self, request: EngineRequest) -> RemoteStream:
        loop = asyncio.get_running_loop()
        stream = RemoteStream(self, request.request_id, loop)

        async def place() -> None:
            try:
                await self.add(stream, request)
            except Exception as e:  # noqa: BLE001
                stream._accept(e)
            else:
                stream._accept(None)

        loop.create_task(place())
        return stream

    async def add(self, stream: RemoteStream, request: EngineRequest) -> None:
        """Queue `stream`'s request on this replica; raises its refusal (InvalidRequestError, QueueFullError,
        EngineDeadError). The stream is registered first, so no output can arrive before it."""
        if not self.is_running:
            raise EngineDeadError(f"Replica {self.name} is down.")
        rid = stream.request_id
        with self._lock:
            self._streams[rid] = stream
        stream.client = self
        stream.attempts += 1
        try:
            err = await self.actor.add.remote(request, time.monotonic() - request.arrival_time)
        except self._ray.exceptions.RayError as e:
            err = EngineDeadError(f"Replica {self.name} is unavailable ({type(e).__name__}).").to_wire()
        if err is not None:
            with self._lock:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            raise err.error()
        if stream.finished:  # aborted while it was being placed
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if self._stop.is_set():  # shut down: nothing left to free, and Ray may be restarting
            return
        try:
            self.actor.abort.remote([request_id])
        except Exception:  # noqa: BLE001 - a dead replica frees nothing, and needs nothing freed
            pass

    async def snapshot(self, show_text: bool = False) -> EngineSnapshot:
        return await self.actor.snapshot.remote(show_text)

    def fail_all(self, message: str) -> None:
        try:
            self.actor.fail_all.remote(message)
        except Exception:  # noqa: BLE001
            pass

    def shutdown(self, timeout: float = 10.0, remote: bool = True) -> None:
        """Stop polling and fail the open requests; `remote`: also shut the actor's engine down."""
        self._stop.set()
        self._thread.join(timeout)
        for stream in self._take_streams():
            self._deliver(stream, EngineDeadError("The engine was shut down."))
        if not remote:
            return
        try:
            self._ray.get(self.actor.shutdown.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001
            pass

    def prefix_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its `prompt_block_hashes`) this replica has cached, or will have
        once the requests just sent to it are prefilled (`expect`)."""
        n = 0
        cached, expected = self.cached, self._expected
        for h in hashes:
            if h not in cached and h not in expected:
                break
            n += 1
        return n

    def expect(self, hashes: list[int]) -> None:
        """Count a prompt just sent here as cached until the replica publishes it (for `EXPECT_S` seconds), so
        that a burst of requests sharing a prefix follows the first one."""
        now, expected = time.monotonic(), self._expected
        for h in hashes:
            expected.pop(h, None)
            expected[h] = now + self.EXPECT_S
        while expected:
            h, until = next(iter(expected.items()))
            if until > now and len(expected) <= self.MAX_EXPECTED:
                break
            del expected[h]

    # --- the pump thread -------------------------------------------------------------------------------
    def _pump(self) -> None:
        ray = self._ray
        while not self._stop.is_set():
            try:
                poll = ray.get(self.actor.poll.remote(self.poll_timeout), timeout=self.health_timeout)
            except ray.exceptions.GetTimeoutError:
                self._lost(f"did not answer a health check within {self.health_timeout:g} s", hung=True)
                continue
            except ray.exceptions.RayError as e:
                self._lost(f"failed ({type(e).__name__})", hung=False)
                continue
            except Exception:  # noqa: BLE001 - e.g. Ray shut down under us
                if self._stop.is_set():
                    return
                logger.exception("Polling replica %s failed", self.name)
                time.sleep(0.5)
                continue
            self._apply(poll)

    def _apply(self, poll: ReplicaPoll) -> None:
        rec = poll.record
        self.stats = rec.stats
        r, f, s = poll.counters
        self.num_rejected, self.num_failed, self.num_stalled = self._base[0] + r, self._base[1] + f, self._base[2] + s
        if poll.cache_snapshot is not None:
            self.cached = set(poll.cache_snapshot)
        self.cached.difference_update(poll.cache_removed)
        self.cached.update(poll.cache_stored)
        if not poll.running and self.healthy:
            self._lost("its engine loop stopped", hung=True)
            return
        with self._lock:
            items = [(self._streams[rid], out) for rid, out in poll.outputs.items() if rid in self._streams]
            for rid, out in poll.outputs.items():
                if isinstance(out, WireError) or out.finished:
                    self._streams.pop(rid, None)
        deliver([(stream, out.error() if isinstance(out, WireError) else out) for stream, out in items],
                lambda stream: self.abort(stream.request_id))
        if self.stall_timeout > 0:
            self._fail_stalled()
        if rec.ttft or rec.itl or rec.finished:
            self._notify(rec)

    def _fail_stalled(self) -> None:
        now = time.monotonic()
        for stream in list(self._streams.values()):
            if stream.stalled(self.stall_timeout, now):
                self.num_stalled += 1
                self._base = (self._base[0], self._base[1], self._base[2] + 1)
                self.abort(stream.request_id)
                self._deliver(stream, stalled_error(stream.request_id, self.stall_timeout))

    def _take_streams(self) -> list[RemoteStream]:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        return streams

    def _deliver(self, stream: RemoteStream, item: object) -> None:
        deliver([(stream, item)], lambda _: None)

    def _lost(self, why: str, hung: bool) -> None:
        """Take the replica out, hand over its requests, and wait (on this thread) until Ray restarted it."""
        ray = self._ray
        logger.warning("Replica %s (pid %d) %s; taking it out", self.name, self.pid, why)
        self.healthy = False
        self._base = (self.num_rejected, self.num_failed, self.num_stalled)
        self.cached, self._expected = set(), {}
        error = EngineDeadError(f"Replica {self.name} was lost ({why}).")
        for stream in self._take_streams():
            if self.on_lost is not None:
                try:
                    self.on_lost(stream, error)
                    continue
                except Exception:  # noqa: BLE001
                    logger.exception("Handing over a request of replica %s failed", self.name)
            self._deliver(stream, error)
        if hung:
            try:
                ray.kill(self.actor, no_restart=False)
            except Exception:  # noqa: BLE001
                logger.exception("Killing replica %s failed", self.name)
        delay = 0.2
        while not self._stop.is_set():
            try:
                info = ray.get(self.actor.info.remote(), timeout=max(self.health_timeout, 30.0))
            except Exception as e:  # noqa: BLE001 - still restarting, or gone for good
                logger.debug("Replica %s not back yet: %s", self.name, e)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            if info.pid != self.pid or info.node != self.info.node:
                self.restarts += 1
            self.info, self.pid, self.stats = info, info.pid, info.stats
            try:
                ray.get(self.actor.resync.remote(), timeout=self.health_timeout)
            except Exception:  # noqa: BLE001
                continue
            self.healthy = True
            logger.warning("Replica %s is back (pid %d, restarts %d)", self.name, self.pid, self.restarts)
            return


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
