"""What the server sees of an engine: `EngineClient` (submit a request, get its `RequestStream`) and the stream.

One contract for a local engine (`AsyncLLMEngine`), one replica in another process (`ReplicaClient`) and a set
of replicas (`ReplicaSet`): the stream bookkeeping they share (the facts read through the facade, open streams,
listeners, add_request / generate over submit, delivering outputs to the callers' event loops) lives here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedlm.engine.llm_engine import EngineStats
from pagedlm.outputs import RequestOutput
from pagedlm.sampling.params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.engine.facade import EngineFacade

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What one loop iteration did; handed to listeners on the engine thread (for metrics)."""

    stats: EngineStats
    ttft: list[float] = field(default_factory=list)  # arrival -> first token, per request that got one now
    itl: list[float] = field(default_factory=list)  # gap since the request's previous output
    finished: list[RequestOutput] = field(default_factory=list)  # finished, aborted and failed requests


class RequestStream:
    """One request's outputs, as an async iterator on the loop that submitted it.

    Yields cumulative `RequestOutput`s and stops after the finished one; raises `RequestFailedError` /
    `EngineDeadError` if the engine fails it. `abort()` (idempotent) frees the request at once.
    Outputs are cumulative, so only the newest one is kept (as vLLM merges pending outputs): a consumer that
    falls behind skips to the latest state, and a stream nobody reads holds one output, not one per step.
    """

    def __init__(self, owner: EngineClient, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
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
        stream._put(item)


class EngineClient:
    """An engine as the server uses it. A subclass sets `facade` (the engine's facts and front-end checks),
    `_streams` (open requests by id) and `_listeners`, and implements `submit` (hand a request over without
    waiting; its stream says the verdict), `abort`, `is_running`, `fail_all` and `shutdown`."""

    facade: EngineFacade
    _streams: dict[str, RequestStream]
    _listeners: list[Callable[[StepRecord], None]]

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

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
               arrival_time: float | None = None, cache_salt: str | None = None) -> RequestStream:
        """Hand a request over without waiting; `await stream.accepted()` for the verdict."""
        raise NotImplementedError

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
        """Abort a request by id (no-op if unknown or finished)."""
        raise NotImplementedError

    def fail_all(self, message: str) -> None:
        """Fail every open request with RequestFailedError(message)."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError
