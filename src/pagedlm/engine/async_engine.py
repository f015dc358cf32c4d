"""AsyncLLMEngine: one background thread steps an `LLMEngine`; asyncio callers stream its outputs.

The engine is touched only by that thread. Callers hand it checked requests (`EngineRequest`) and aborts through
a thread-safe queue; it applies them between steps, steps while there is work, and sleeps on the queue when idle.
Each request's `EngineOutput` deltas go back to the caller's event loop (`call_soon_threadsafe`) into its stream.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedlm.config import LoopConfig
from pagedlm.engine.client import EngineClient, RequestStream, StepRecord, deliver
from pagedlm.engine.errors import EngineDeadError, QueueFullError, RequestFailedError, failed, stalled_error
from pagedlm.engine.llm_engine import EngineStats, LLMEngine
from pagedlm.engine.protocol import EngineOutput, EngineRequest
from pagedlm.engine.snapshot import EngineSnapshot, build_snapshot

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    stream: RequestStream
    request: EngineRequest


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    message: str


@dataclass
class _Snapshot:
    future: concurrent.futures.Future
    show_text: bool


_STOP = object()


class AsyncLLMEngine(EngineClient):
    """Owns `engine` and the thread that steps it (started here; stop it with `shutdown()`). Other threads
    use the engine only through `input_processor` (its facts and request checks). `loop` (LoopConfig, default
    `LoopConfig.offline()`) bounds the waiting queue, stalled streams and the throughput log. Listeners
    (`add_listener`) run on the engine thread after every loop iteration."""

    def __init__(self, engine: LLMEngine, loop: LoopConfig | None = None) -> None:
        self.loop_config = loop = loop or LoopConfig.offline()
        self.engine = engine
        self.input_processor = engine.input_processor
        self.max_waiting = loop.max_waiting
        self.stall_timeout = loop.stream_stall_timeout
        self.stats: EngineStats = engine.get_stats()  # snapshot, refreshed by the engine thread
        # requests failed because nobody read their outputs / refused (waiting queue full) / failed by an error
        self.num_stalled = self.num_rejected = self.num_failed = 0
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._dead: BaseException | None = None
        self._step_since: float | None = None  # when the running step began (None between steps)
        self._closing = threading.Lock()  # submit's check-and-enqueue against the loop's final drain
        self._log = ThroughputLog(loop.log_interval, self.stats)
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
    def submit(self, request: EngineRequest) -> RequestStream:
        """Hand a request to the engine thread without waiting; `await stream.accepted()` for the verdict."""
        stream = RequestStream(self, request.request_id, asyncio.get_running_loop())
        with self._closing:  # the loop sets _dead, then drains the queue under this lock: nothing is left behind
            dead = self._dead is not None
            if not dead:
                self._submit(_Add(stream, request))
        if dead:
            stream.accept(self._dead_error())
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if unknown or finished); its blocks are freed before the next step."""
        self._submit(_Abort(request_id))

    def fail_all(self, message: str) -> None:
        """Fail every open request with RequestFailedError(message) (e.g. at the end of a graceful shutdown)."""
        self._submit(_FailAll(message))

    async def snapshot(self, show_text: bool = False) -> EngineSnapshot:
        """The engine's memory state, built on the engine thread before its next step (snapshot.py)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._closing:
            if self._dead is None:
                self._submit(_Snapshot(future, show_text))
            else:
                future.set_exception(self._dead_error())
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; open requests fail with EngineDeadError."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()  # the disk tier's queued writes

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
                            err = failed(cmd.stream.request_id, e)
                            self._fail(cmd.stream.request_id, err, record)
                            self._call(cmd.stream, cmd.stream.accept, err)
                progressed = False
                if self.engine.has_unfinished_requests():
                    failures, progressed = self._step(record, failures)
                if self.stall_timeout > 0:
                    self._fail_stalled(record)
                record.stats = self.stats = self.engine.get_stats()
                # Work that cannot be scheduled (nothing runs, nothing came out): poll instead of spinning.
                stalled = not progressed and self.stats.num_running == 0
                self._notify(record)
                self._log.maybe_log(self.stats, self.engine.has_unfinished_requests())
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
                        self._call(cmd.stream, cmd.stream.accept, err)
                    elif isinstance(cmd, _Snapshot) and cmd.future.set_running_or_notify_cancel():
                        cmd.future.set_exception(err)

    def _dead_error(self) -> EngineDeadError:
        dead = self._dead
        return dead if isinstance(dead, EngineDeadError) else EngineDeadError(
            f"The engine loop has stopped ({type(dead).__name__}); see the server log.")

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
            next_log = self._log.seconds_to_next()
            if next_log is not None:
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
        if isinstance(cmd, _Snapshot):
            if cmd.future.set_running_or_notify_cancel():  # nobody waits any more: nothing is built
                try:
                    cmd.future.set_result(build_snapshot(self.engine, cmd.show_text))
                except Exception as e:  # noqa: BLE001 - the watcher gets the error, the loop goes on
                    cmd.future.set_exception(e)
            return
        if isinstance(cmd, _FailAll):
            for rid in list(self._streams):
                self.num_failed += 1
                self._fail(rid, RequestFailedError(cmd.message), record)
            return
        if isinstance(cmd, _Abort):
            self._streams.pop(cmd.request_id, None)
            out = self.engine.abort_output(cmd.request_id)
            if out is not None:
                record.finished.append(out.stats)
            return
        assert isinstance(cmd, _Add)
        stream = cmd.stream
        error: BaseException | None = None
        if len(self.engine.scheduler.waiting) >= self.max_waiting:
            self.num_rejected += 1
            error = QueueFullError(f"The waiting queue is full ({self.max_waiting} requests); retry later.")
        else:
            try:
                self.engine.add_request(cmd.request)
                self._streams[stream.request_id] = stream
            except Exception as e:  # noqa: BLE001 - InvalidRequestError for a used id; anything else reported too
                error = e
        self._call(stream, stream.accept, error)

    def _step(self, record: StepRecord, failures: int) -> tuple[int, bool]:
        """One engine step; returns (consecutive failures, whether any output came out)."""
        self._log.resume(self.stats)
        self._step_since = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            logger.exception("Engine step failed; failing the requests it ran")
            running = [r.request_id for r in self.engine.scheduler.running]
            ids = running if running and failures == 0 else list(self._streams)
            for rid in ids:
                self.num_failed += 1
                self._fail(rid, failed(rid, e), record)
            return failures + 1, True
        finally:
            self._step_since = None
        self._log.active = True
        now = time.monotonic()
        items = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                record.finished.append(out.stats)
            if stream is None:
                continue
            if out.error is not None:  # the engine failed this request alone
                self.num_failed += 1
                items.append((stream, out.error))
                continue
            m = out.metrics
            if stream._last_output_time is not None:
                record.itl.append(now - stream._last_output_time)
            elif m is not None and m.first_token_time is not None:
                record.ttft.append(m.first_token_time - m.arrival_time)
            stream._last_output_time = now
            items.append((stream, out))
        self._deliver(items)
        return 0, bool(outputs)

    def _fail(self, request_id: str, error: BaseException, record: StepRecord) -> None:
        stream = self._streams.pop(request_id, None)
        try:
            out = self.engine.abort_output(request_id)
            if out is not None:
                record.finished.append(out.stats)
        except Exception:  # noqa: BLE001
            logger.exception("Aborting request %s failed", request_id)
        if stream is not None:
            self._deliver([(stream, error)])

    def _deliver(self, items: list[tuple[RequestStream, EngineOutput | BaseException]]) -> None:
        deliver(items, lambda stream: self.abort(stream.request_id))

    def _call(self, stream: RequestStream, fn: Callable, *args) -> None:
        try:
            stream.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            self._inbox.put(_Abort(stream.request_id))



class ThroughputLog:
    """A throughput line every `interval` seconds while the engine is active (0: none), vLLM's format."""

    def __init__(self, interval: float, stats: EngineStats) -> None:
        self.interval, self.active = interval, False
        self._state = (time.monotonic(), stats.prompt_tokens, stats.generation_tokens)

    def resume(self, stats: EngineStats) -> None:
        """A step starts: after an idle time, the throughput window starts now, not when idleness began."""
        if not self.active:
            self._state = (time.monotonic(), stats.prompt_tokens, stats.generation_tokens)

    def seconds_to_next(self) -> float | None:
        """How long an idle loop may sleep before the next line is due (None: no line is due)."""
        if not self.active or self.interval <= 0:
            return None
        return max(self._state[0] + self.interval - time.monotonic(), 0.0)

    def maybe_log(self, s: EngineStats, busy: bool) -> None:
        t0, p0, g0 = self._state
        now = time.monotonic()
        if self.interval <= 0 or not self.active or now - t0 < self.interval:
            return
        dt = now - t0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Preemptions: %d", (s.prompt_tokens - p0) / dt, (s.generation_tokens - g0) / dt,
                    s.num_running, s.num_swapped, s.num_waiting, 100 * s.kv_cache_usage, s.num_preemptions)
        sd = s.spec_decode
        if sd.num_drafts:
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d "
                        "tokens, Avg Draft acceptance rate: %.1f%%", sd.mean_accepted_length, sd.num_accepted_tokens,
                        sd.num_draft_tokens, 100 * sd.acceptance_rate)
        self._state = (now, s.prompt_tokens, s.generation_tokens)
        self.active = busy
