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
from collections.abc import Callable
from dataclasses import dataclass

from pagedlm.engine.client import EngineClient, RequestStream, StepRecord, deliver
from pagedlm.engine.errors import EngineDeadError, QueueFullError, RequestFailedError, stalled_error
from pagedlm.engine.facade import EngineFacade
from pagedlm.engine.llm_engine import EngineStats, LLMEngine
from pagedlm.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


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


class AsyncLLMEngine(EngineClient):
    """Owns `engine` and the thread that steps it (started here; stop it with `shutdown()`). Other threads
    read the engine only through `facade` (its facts and front-end checks, built here before the thread starts).

    max_waiting: requests the scheduler may hold waiting before `add_request` raises QueueFullError.
    log_interval: seconds between throughput log lines while active (0 disables them).
    stall_timeout: a request whose newest output has waited unread this many seconds (a client that stopped
    reading its stream) is failed and its blocks freed (0 disables).
    Listeners (`add_listener`) run on the engine thread after every loop iteration.
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
        self._step_since: float | None = None  # when the running step began (None between steps)
        self._closing = threading.Lock()  # submit's check-and-enqueue against the loop's final drain
        self._log_state = (time.monotonic(), self.stats.prompt_tokens, self.stats.generation_tokens)
        self._active_since_log = False
        self._thread = threading.Thread(target=self._run, name="pagedlm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def step_stuck_for(self) -> float:
        since = self._step_since
        if since is None or not (self.stats.num_waiting or not self._inbox.empty()):
            return 0.0
        return time.monotonic() - since

    # --- requests ------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None, cache_salt: str | None = None) -> RequestStream:
        """Hand a request to the engine thread without waiting; `await stream.accepted()` for the verdict."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        with self._closing:  # the loop sets _dead, then drains the queue under this lock: nothing is left behind
            dead = self._dead is not None
            if not dead:
                self._submit(_Add(stream, prompt, params, priority,
                                  time.monotonic() if arrival_time is None else arrival_time, cache_salt))
        if dead:
            stream._accept(self._dead_error())
        return stream

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
            with self._closing:  # requests that arrived after the end (none can arrive after this)
                while True:
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
            if stream.stalled(self.stall_timeout, now):
                logger.warning("Request %s: nobody read its output for %.0f s; aborting it", rid,
                               now - stream.unread_since)
                self.num_stalled += 1
                self._fail(rid, stalled_error(rid, self.stall_timeout), record)

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
        self._step_since = time.monotonic()
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
        finally:
            self._step_since = None
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
        deliver(items, lambda stream: self.abort(stream.request_id))

    def _call(self, stream: RequestStream, fn: Callable, *args) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            self._inbox.put(_Abort(stream.request_id))

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
