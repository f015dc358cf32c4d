"""The front end's proxy of one replica actor: `ReplicaClient.submit` returns a `RemoteStream` with
`RequestStream`'s contract (accepted / async iteration / abort / unread_since), a pump thread long-polls the actor
and delivers outputs to the caller's event loop, and the same thread checks health: a replica whose process died,
or whose poll does not answer within `health_timeout`, is taken out (its open streams are handed to `on_lost`, or
failed with EngineDeadError), killed if it hung, and back once Ray restarted it (`restarts` counts it).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pagedlm.config import LoopConfig
from pagedlm.dp.prefix_index import PrefixIndex
from pagedlm.dp.wire import ReplicaInfo, ReplicaPoll
from pagedlm.engine.client import EngineClient, RequestStream, StepRecord, deliver
from pagedlm.engine.errors import EngineDeadError, WireError, stalled_error
from pagedlm.engine.input_processor import InputProcessor
from pagedlm.engine.llm_engine import EngineStats
from pagedlm.engine.protocol import EngineOutput, EngineRequest
from pagedlm.engine.snapshot import EngineSnapshot

logger = logging.getLogger(__name__)


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
        self.prefix = PrefixIndex()  # what its prefix cache holds, as published
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
                stream.accept(e)
            else:
                stream.accept(None)

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

    def carry_over(self, prev: ReplicaClient) -> None:
        """This client replaces `prev` (Ray and its replicas were restarted): continue its counters."""
        self.restarts = prev.restarts + 1
        self._base = (prev.num_rejected, prev.num_failed, prev.num_stalled)
        self.num_rejected, self.num_failed, self.num_stalled = self._base

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
        self.prefix.apply(poll.cache_snapshot, poll.cache_stored, poll.cache_removed)
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
        self.prefix.clear()
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

