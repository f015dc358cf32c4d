"""What the server sees of an engine: `EngineClient` (submit an `EngineRequest`, get its `RequestStream`) and the
stream of its `EngineOutput` deltas.

One contract for a local engine (`AsyncLLMEngine`), one replica in another process (`ReplicaClient`) and a set
of replicas (`ReplicaSet`): the stream bookkeeping they share (open streams, listeners, add_request / generate
over submit, delivering outputs to the callers' event loops) lives here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from pagedlm.engine.protocol import EngineOutput, EngineRequest, FinishedRequestStats, OutputAccumulator, merge_outputs
from pagedlm.outputs import RequestOutput
from pagedlm.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.engine.input_processor import InputProcessor
    from pagedlm.engine.llm_engine import EngineStats
    from pagedlm.engine.snapshot import EngineSnapshot

logger = logging.getLogger(__name__)
MAX_PENDING = 64  # outputs a stream keeps apart before merging them


@dataclass
class StepRecord:
    """What one loop iteration did; handed to listeners on the engine thread (for metrics)."""

    stats: EngineStats
    ttft: list[float] = field(default_factory=list)  # arrival -> first token, per request that got one now
    itl: list[float] = field(default_factory=list)  # gap since the request's previous output
    finished: list[FinishedRequestStats] = field(default_factory=list)  # finished, aborted and failed requests


class RequestStream:
    """One request's `EngineOutput` deltas, as an async iterator on the loop that submitted it.

    Yields deltas and stops after the finished one; raises the request's EngineError (`RequestFailedError`,
    `EngineDeadError`) if the engine fails it. Deltas the consumer has not taken yet merge into one (as vLLM
    merges pending delta outputs): a consumer that falls behind takes them together. `result()` folds the whole
    request into its `RequestOutput`. `abort()` (idempotent) frees the request at once.
    """

    def __init__(self, owner: EngineClient, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._pending: list[EngineOutput] = []  # outputs not yet taken
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        # monotonic time since which an output waits unread (None: nothing waits); read by the engine thread
        self.unread_since: float | None = None
        self._accepted: asyncio.Future = loop.create_future()
        self._last_output_time: float | None = None  # engine thread only
        self._result: OutputAccumulator | None = None
        self.buffered = False  # set by a consumer that sends the client nothing before the end (`result`): a
        # replica set may then still retry the request elsewhere after outputs were taken (`restart`)

    async def accepted(self) -> None:
        """Wait until the engine queued the request; raises InvalidRequestError / QueueFullError /
        EngineDeadError. If the wait is cancelled, the request is aborted."""
        try:
            await asyncio.shield(self._accepted)
        except BaseException:
            self.abort()
            raise

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        await self.wait_output()
        if not self._pending:
            raise StopAsyncIteration
        item, self._pending, self.unread_since = merge_outputs(self._pending), [], None
        if item.finished:
            self.finished = True
        if self._result is not None:
            self._result.add(item)
        return item

    next_latest = __anext__  # what is pending, merged

    async def wait_output(self) -> None:
        """Wait until the next output is ready without consuming it (returns at once when the stream ended);
        raises the failure if that is what came."""
        while not self._pending and not self.finished and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._error is not None:
            self.finished = True
            error, self._error = self._error, None
            raise error

    async def result(self) -> RequestOutput:
        """The whole request, once it finished (nothing is shown before: `buffered`)."""
        self.buffered = True
        self._result = OutputAccumulator(self.request_id)
        async for _ in self:
            pass
        return self._result.output()

    def restart(self) -> None:
        """The request runs again from the start (a replica set placed it elsewhere): what was pending, and what
        `result` gathered, is dropped."""
        self._pending, self.unread_since = [], None
        if self._result is not None:
            self._result = OutputAccumulator(self.request_id)

    def stalled(self, timeout: float, now: float) -> bool:
        """Whether an output has waited unread for more than `timeout` seconds at monotonic time `now`."""
        since = self.unread_since
        return since is not None and now - since > timeout

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._ready.set()
            self._release()

    def _release(self) -> None:
        """Free the aborted request where it runs."""
        self._owner.abort(self.request_id)

    # --- called on the stream's loop (from another thread: through `call_soon_threadsafe`) ---
    def call_soon_threadsafe(self, fn: Callable, *args: object) -> None:
        """Run `fn(*args)` on the stream's event loop (from any thread); RuntimeError if that loop is closed."""
        self._loop.call_soon_threadsafe(fn, *args)

    def accept(self, error: BaseException | None = None) -> None:
        """Settle `accepted()`: the request is queued (None), or refused with `error` (the stream then ends).
        Only the first verdict counts."""
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self.finished = True
            self._accepted.set_exception(error)

    def put(self, item: EngineOutput | BaseException) -> None:
        """Deliver an output, or the request's failure (final: nothing after it is delivered)."""
        if self._error is not None:
            return  # a failure is final
        if isinstance(item, BaseException):
            self._error, self._pending = item, []
        else:
            self._pending.append(item)
            if len(self._pending) >= MAX_PENDING:  # a consumer far behind: one output, not one per step
                self._pending = [merge_outputs(self._pending)]
        if self.unread_since is None:
            self.unread_since = time.monotonic()
        self._ready.set()


def deliver(items: Iterable[tuple[RequestStream, object]], on_closed: Callable[[RequestStream], None]) -> None:
    """Hand each (stream, output or error) to its stream on the stream's event loop (any thread; one callback
    per loop). A stream whose loop is closed (nobody will read it) goes to `on_closed`."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for stream, item in items:
        by_loop[stream._loop].append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            for stream, _ in batch:
                on_closed(stream)


def _put_all(batch: list[tuple[RequestStream, object]]) -> None:
    for stream, item in batch:
        stream.put(item)


class EngineClient:
    """An engine as the server uses it: everything the server reads or calls is declared here.

    A subclass sets `input_processor` (the engine's facts and request checks), `loop` settings (`max_waiting`,
    `stall_timeout`), `stats`, the counters, `_streams` (open requests by id) and `_listeners`, and implements
    `submit` (hand a checked request over without waiting; its stream says the verdict), `abort`, `is_running`,
    `fail_all` and `shutdown`. A client of several replicas lists them in `replicas`."""

    input_processor: InputProcessor
    max_waiting: int
    stall_timeout: float  # seconds an output may wait unread before the request is failed (0: never)
    stats: EngineStats  # the newest snapshot
    num_rejected: int = 0  # requests refused because the waiting queue was full
    num_failed: int = 0  # requests failed by an engine error
    num_stalled: int = 0  # requests failed because nobody read their outputs
    restarts: int = 0  # times the engine's process was restarted (a replica)
    replicas: Mapping[str, EngineClient] = MappingProxyType({})  # the replicas behind it, by name (none: one engine)
    _streams: dict[str, RequestStream]
    _listeners: list[Callable[[StepRecord], None]]

    def retries_of(self, replica: str) -> int:
        """Requests moved away from `replica` after losing it before sending anything."""
        return 0

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.input_processor.max_model_len

    @property
    def num_open_requests(self) -> int:
        """Requests accepted and not yet finished (read from any thread)."""
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    @property
    def down_reason(self) -> str | None:
        """Why the engine cannot serve now (said by /health), or None while it can."""
        return None if self.is_running else "the engine loop has stopped"

    @property
    def step_stuck_for(self) -> float:
        """Seconds the engine's current step has run while other requests wait for it (0: none such)."""
        return 0.0

    def add_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """`fn(record)` runs on the engine's thread (it must be quick) with its step records."""
        self._listeners.append(fn)

    def _notify(self, record: StepRecord) -> None:
        for fn in self._listeners:
            try:
                fn(record)
            except Exception:  # noqa: BLE001
                logger.exception("Engine listener failed")

    def submit(self, request: EngineRequest) -> RequestStream:
        """Hand a request (built and checked by `input_processor`) over without waiting; `await
        stream.accepted()` for the verdict."""
        raise NotImplementedError

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, arrival_time: float | None = None) -> RequestStream:
        """Check (on a worker thread) and queue a request; raises InvalidRequestError (a ValueError) or
        QueueFullError, with nothing queued."""
        request = await asyncio.to_thread(self.input_processor.process, request_id, prompt, params, arrival_time,
                                          priority)
        stream = self.submit(request)
        await stream.accepted()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs (each a copy) as they are produced. Closing the generator early
        aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority)
        acc = OutputAccumulator(request_id)
        try:
            async for out in stream:
                acc.add(out)
                yield acc.snapshot()
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if unknown or finished)."""
        raise NotImplementedError

    def fail_all(self, message: str) -> None:
        """Fail every open request with RequestFailedError(message)."""
        raise NotImplementedError

    async def snapshot(self, show_text: bool = False) -> EngineSnapshot:
        """The engine's memory state (engine/snapshot.py), built between two steps; NotImplementedError where the
        engine cannot show it (a replica set shows each of its `replicas`)."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError
