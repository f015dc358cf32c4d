"""AsyncLLMEngine: one background thread steps an `LLMEngine`; asyncio callers stream its outputs.

The engine is touched only by that thread. Callers hand it requests and aborts through a thread-safe
queue; it applies them between steps, steps while there is work, and sleeps on the queue when idle.
Each request's outputs go back to the caller's event loop (`call_soon_threadsafe`) into its own queue.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedlm.engine.facade import EngineFacade
from pagedlm.engine.llm_engine import EngineStats, LLMEngine
from pagedlm.outputs import RequestOutput
from pagedlm.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting` requests; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request, which was aborted (its blocks freed)."""


@dataclass
class StepRecord:
    """What one loop iteration did; handed to listeners on the engine thread (for metrics)."""

    stats: EngineStats
    ttft: list[float] = field(default_factory=list)  # arrival -> first token, per request that got one now
    itl: list[float] = field(default_factory=list)  # gap since the request's previous output
    finished: list[RequestOutput] = field(default_factory=list)  # finished, aborted and failed requests


@dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    message: str


_STOP = object()


class RequestStream:
    """One request's outputs, as an async iterator on the loop that submitted it.

    Yields cumulative `RequestOutput`s and stops after the finished one; raises `RequestFailedError` /
    `EngineDeadError` if the engine fails it. `abort()` (idempotent) frees the request at once.
    Outputs are cumulative, so only the newest one is kept (as vLLM merges pending outputs): a consumer that
    falls behind skips to the latest state, and a stream nobody reads holds one output, not one per step.
    """

    def __init__(self, owner: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._pending: RequestOutput | BaseException | None = None  # the newest output not yet taken
        self._ready = asyncio.Event()
        # monotonic time since which an output waits unread (None: nothing waits); read by the engine thread
        self.unread_since: float | None = None
        self._accepted: asyncio.Future = loop.create_future()
        self._last_output_time: float | None = None  # engine thread only
        self.buffered = False  # set by a consumer that sends the client nothing before the end (a replica set
        # may then still retry the request elsewhere after outputs were taken)

    async def accepted(self) -> None:
        """Wait until the engine queued the request; raises ValueError / QueueFullError / EngineDeadError.
        If the wait is cancelled, the request is aborted."""
        try:
            await asyncio.shield(self._accepted)
        except BaseException:
            self.abort()
            raise

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await self.wait_output()
        if self._pending is None:
            raise StopAsyncIteration
        item, self._pending, self.unread_since = self._pending, None, None
        if item.finished:
            self.finished = True
        return item

    next_latest = __anext__  # every output is the latest one: pending outputs are merged

    async def wait_output(self) -> None:
        """Wait until the next output is ready without consuming it (returns at once when the stream ended);
        raises the failure if that is what came."""
        while self._pending is None and not self.finished:
            self._ready.clear()
            await self._ready.wait()
        if isinstance(self._pending, BaseException):
            self.finished = True
            error, self._pending = self._pending, None
            raise error

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._ready.set()
            self._owner._submit(_Abort(self.request_id))

    # --- called on the loop thread, scheduled by the engine thread ---
    def _accept(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self.finished = True
            self._accepted.set_exception(error)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._pending, BaseException):
            return  # a failure is final
        self._pending = item
        if self.unread_since is None:
            self.unread_since = time.monotonic()
        self._ready.set()


class AsyncLLMEngine:
    """Owns `engine` and the thread that steps it (started here; stop it with `shutdown()`). Other threads
    read the engine only through `facade` (its facts and front-end checks, built here before the thread starts).

    max_waiting: requests the scheduler may hold waiting before `add_request` raises QueueFullError.
    log_interval: seconds between throughput log lines while active (0 disables them).
    stall_timeout: a request whose newest output has waited unread this many seconds (a client that stopped
    reading its stream) is failed and its blocks freed (0 disables).
    """

    def __init__(self, engine: LLMEngine, max_waiting: int = 512, log_interval: float = 10.0,
                 stall_timeout: float = 0.0) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}.")
        if stall_timeout < 0:
            raise ValueError(f"stall_timeout must be >= 0, got {stall_timeout}.")
        self.engine = engine
        self.facade = EngineFacade.of(engine)
        self.max_waiting = max_waiting
        self.log_interval = log_interval
        self.stall_timeout = stall_timeout
        self.num_stalled = 0  # requests failed because nobody read their outputs
        self.stats: EngineStats = engine.get_stats()  # snapshot, refreshed by the engine thread
        self.num_rejected = 0  # requests refused because the waiting queue was full
        self.num_failed = 0  # requests failed by an engine error
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._dead: BaseException | None = None
        self._log_state = (time.monotonic(), self.stats.prompt_tokens, self.stats.generation_tokens)
        self._active_since_log = False
        self._thread = threading.Thread(target=self._run, name="pagedlm-engine", daemon=True)
        self._thread.start()

    # --- read-only facts for the API layer ---------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.facade.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.facade.max_model_len

    @property
    def num_open_requests(self) -> int:
        """Requests accepted and not yet finished (read from any thread)."""
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def add_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """`fn(record)` runs on the engine thread after every loop iteration (it must be quick)."""
        self._listeners.append(fn)

    # --- requests ------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None, cache_salt: str | None = None) -> RequestStream:
        """Hand a request to the engine thread without waiting; `await stream.accepted()` for the verdict."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        if self._dead is not None:
            stream._accept(self._dead_error())
        else:
            self._submit(_Add(stream, prompt, params, priority,
                              time.monotonic() if arrival_time is None else arrival_time, cache_salt))
        return stream

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        """Queue a request; raises ValueError (bad input) or QueueFullError, with nothing queued."""
        stream = self.submit(request_id, prompt, params, priority, arrival_time)
        await stream.accepted()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are produced. Closing the generator early aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if unknown or finished); its blocks are freed before the next step."""
        self._submit(_Abort(request_id))

    def fail_all(self, message: str) -> None:
        """Fail every open request with RequestFailedError(message) (e.g. at the end of a graceful shutdown)."""
        self._submit(_FailAll(message))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; open requests fail with EngineDeadError."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    def _submit(self, cmd: object) -> None:
        self._inbox.put(cmd)

    # --- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            failures, stalled = 0, False
            while True:
                cmds = self._wait_for_commands(stalled)
                if any(c is _STOP for c in cmds):
                    break
                record = StepRecord(self.stats)
                for cmd in cmds:
                    try:
                        self._apply(cmd, record)
                    except Exception as e:  # noqa: BLE001 - a bad command must not end the loop
                        logger.exception("Applying %r failed", cmd)
                        if isinstance(cmd, _Add):
                            err = _failed(cmd.stream.request_id, e)
                            self._fail(cmd.stream.request_id, err, record)
                            self._call(cmd.stream, cmd.stream._accept, err)
                progressed = False
                if self.engine.has_unfinished_requests():
                    failures, progressed = self._step(record, failures)
                if self.stall_timeout > 0:
                    self._fail_stalled(record)
                record.stats = self.stats = self.engine.get_stats()
                # Work that cannot be scheduled (nothing runs, nothing came out): poll instead of spinning.
                stalled = not progressed and self.stats.num_running == 0
                self._notify(record)
                self._maybe_log()
            self._dead = EngineDeadError("The engine was shut down.")
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("The engine loop died")
            self._dead = e
        finally:
            err = self._dead_error()
            for stream in list(self._streams.values()):
                self._deliver([(stream, err)])
            self._streams.clear()
            while True:  # requests that arrived after the end
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, _Add):
                    self._call(cmd.stream, cmd.stream._accept, err)

    def _dead_error(self) -> EngineDeadError:
        if isinstance(self._dead, EngineDeadError):
            return self._dead
        return EngineDeadError(f"The engine loop has stopped ({type(self._dead).__name__}); see the server log.")

    def _fail_stalled(self, record: StepRecord) -> None:
        now = time.monotonic()
        for rid, stream in list(self._streams.items()):
            since = stream.unread_since
            if since is not None and now - since > self.stall_timeout:
                logger.warning("Request %s: nobody read its output for %.0f s; aborting it", rid, now - since)
                self.num_stalled += 1
                self._fail(rid, RequestFailedError(f"Request {rid} was aborted: its output was not read for "
                                                   f"{self.stall_timeout:g} s."), record)

    def _wait_for_commands(self, stalled: bool) -> list[object]:
        cmds = []
        if stalled or not self.engine.has_unfinished_requests():
            timeout = 0.05 if stalled else None
            if self.stall_timeout > 0 and self._streams:
                timeout = min(timeout or self.stall_timeout, self.stall_timeout)
            if self._active_since_log and self.log_interval > 0:
                next_log = max(self._log_state[0] + self.log_interval - time.monotonic(), 0.0)
                timeout = next_log if timeout is None else min(timeout, next_log)
            try:
                cmds.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd: object, record: StepRecord) -> None:
        if isinstance(cmd, _FailAll):
            for rid in list(self._streams):
                self.num_failed += 1
                self._fail(rid, RequestFailedError(cmd.message), record)
            return
        if isinstance(cmd, _Abort):
            self._streams.pop(cmd.request_id, None)
            out = self.engine.abort_output(cmd.request_id)
            if out is not None:
                record.finished.append(out)
            return
        assert isinstance(cmd, _Add)
        stream = cmd.stream
        error: BaseException | None = None
        if len(self.engine.scheduler.waiting) >= self.max_waiting:
            self.num_rejected += 1
            error = QueueFullError(f"The waiting queue is full ({self.max_waiting} requests); retry later.")
        else:
            try:
                self.engine.add_request(stream.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.priority,
                                        cmd.cache_salt)
                self._streams[stream.request_id] = stream
            except Exception as e:  # noqa: BLE001 - ValueError for bad input; anything else is reported too
                error = e
        self._call(stream, stream._accept, error)

    def _step(self, record: StepRecord, failures: int) -> tuple[int, bool]:
        """One engine step; returns (consecutive failures, whether any output came out)."""
        if not self._active_since_log:  # activity resumes: the throughput window starts now, not when idle began
            self._log_state = (time.monotonic(), self.stats.prompt_tokens, self.stats.generation_tokens)
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            logger.exception("Engine step failed; failing the requests it ran")
            running = [r.request_id for r in self.engine.scheduler.running]
            ids = running if running and failures == 0 else list(self._streams)
            for rid in ids:
                self.num_failed += 1
                self._fail(rid, _failed(rid, e), record)
            return failures + 1, True
        self._active_since_log = True
        now = time.monotonic()
        items = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                record.finished.append(out)
            if stream is None:
                continue
            if out.error is not None:  # the engine failed this request alone
                self.num_failed += 1
                items.append((stream, RequestFailedError(f"The engine failed: {out.error}; see the server log.")))
                continue
            m = out.metrics
            if stream._last_output_time is None:
                if m is not None and m.first_token_time is not None:
                    record.ttft.append(m.first_token_time - m.arrival_time)
            else:
                record.itl.append(now - stream._last_output_time)
            stream._last_output_time = now
            items.append((stream, out))
        self._deliver(items)
        return 0, bool(outputs)

    def _fail(self, request_id: str, error: BaseException, record: StepRecord) -> None:
        stream = self._streams.pop(request_id, None)
        try:
            out = self.engine.abort_output(request_id)
            if out is not None:
                record.finished.append(out)
        except Exception:  # noqa: BLE001
            logger.exception("Aborting request %s failed", request_id)
        if stream is not None:
            self._deliver([(stream, error)])

    def _deliver(self, items: list[tuple[RequestStream, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream, item in items:
            by_loop[stream._loop].append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody will read these
                for stream, _ in batch:
                    self._inbox.put(_Abort(stream.request_id))

    def _call(self, stream: RequestStream, fn: Callable, *args) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            self._inbox.put(_Abort(stream.request_id))

    def _notify(self, record: StepRecord) -> None:
        for fn in self._listeners:
            try:
                fn(record)
            except Exception:  # noqa: BLE001
                logger.exception("Engine listener failed")

    def _maybe_log(self) -> None:
        t0, p0, g0 = self._log_state
        now = time.monotonic()
        if self.log_interval <= 0 or not self._active_since_log or now - t0 < self.log_interval:
            return
        s = self.stats
        dt = now - t0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Preemptions: %d", (s.prompt_tokens - p0) / dt, (s.generation_tokens - g0) / dt,
                    s.num_running, s.num_swapped, s.num_waiting, 100 * s.kv_cache_usage, s.num_preemptions)
        self._log_state = (now, s.prompt_tokens, s.generation_tokens)
        self._active_since_log = self.engine.has_unfinished_requests()


def _failed(request_id: str, error: BaseException) -> RequestFailedError:
    """The client-facing failure: the class and the request id (the details are in the log)."""
    return RequestFailedError(f"The engine failed ({type(error).__name__}) while running request {request_id}; "
                              "see the server log.")


def _put_all(batch: list[tuple[RequestStream, object]]) -> None:
    for stream, item in batch:
        stream._put(item)
