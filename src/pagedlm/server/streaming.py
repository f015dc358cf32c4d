"""Streaming plumbing between engine streams and HTTP responses: merging a request's streams, collecting the
final outputs, aborting on client disconnect, what of a choice is not yet sent, and the SSE response (which
closes a stream its client stopped reading)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from pagedlm.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedlm.outputs import CompletionOutput, RequestOutput
from pagedlm.sampling.detokenizer import held_back
from pagedlm.server.protocol import APIError, Unavailable

logger = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceState:
    """What of one choice was sent so far."""

    sent_chars: int = 0
    sent_tokens: int = 0
    text_offset: int = 0
    echoed: bool = False
    done: bool = False


def advance(st: ChoiceState, o: CompletionOutput, stops: list[str]) -> tuple[str, int, int]:
    """Text and token range of `o` not yet sent. Unfinished text that could still grow into a stop string is
    held back, so nothing sent is later cut; returns (text delta, first new token, end of new tokens)."""
    st.done = o.finish_reason is not None
    end = len(o.text) if st.done else max(len(o.text) - held_back(o.text, stops), st.sent_chars)
    text = o.text[st.sent_chars:end]
    t0, t1 = st.sent_tokens, len(o.token_ids)
    st.sent_chars, st.sent_tokens = end, t1
    return text, t0, t1


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Newest outputs of all streams as (stream index, output), in arrival order; ends when all finished."""
    if len(streams) == 1:
        while not streams[0].finished:
            try:
                yield 0, await streams[0].next_latest()
            except StopAsyncIteration:
                return
        return
    pending = {asyncio.ensure_future(s.next_latest()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            ready, error = [], None
            for task in done:
                i = pending.pop(task)
                if task.exception() is None:
                    ready.append((i, task.result()))
                elif not isinstance(task.exception(), StopAsyncIteration):
                    error = error or task.exception()
            if error is not None:
                raise error
            for i, out in ready:
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].next_latest())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


async def collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final outputs; aborts everything if the client disconnects first."""
    finals: list[RequestOutput] = [None] * len(streams)  # type: ignore[list-item]
    for s in streams:
        s.buffered = True  # nothing reaches the client before the end: a lost replica's request may be retried

    async def run() -> None:
        async for i, out in merge(streams):
            finals[i] = out

    try:
        await unless_disconnected(request, run())
    finally:
        abort_all(streams)
    return finals


async def first_outputs(request: Request, streams: list[RequestStream]) -> None:
    """Wait until every stream has an output ready (not consumed); on failure or disconnect, abort them all."""
    try:
        await unless_disconnected(request, asyncio.gather(*(s.wait_output() for s in streams)))
    except BaseException:
        abort_all(streams)
        raise


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> None:
    """Await `work`; 499 if the client disconnects first, `Unavailable` (500) if the engine fails it."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "The client disconnected.")
    try:
        task.result()
    except (RequestFailedError, EngineDeadError) as e:
        raise Unavailable(500, str(e), type="server_error") from None


def event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def event_error(e: APIError) -> str:
    return f"data: {json.dumps(e.body())}\n\n"


async def until_done(events: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """`events`, then `[DONE]`; an engine failure ends them early with an error event and `[DONE]`. The streams
    are aborted at the end."""
    try:
        async for ev in events:
            yield ev
        yield DONE
    except (RequestFailedError, EngineDeadError) as e:
        yield event_error(APIError(500, str(e), type="server_error"))
        yield DONE
    finally:
        abort_all(streams)


class EventStream(StreamingResponse):
    """An SSE response of `events` and `[DONE]` (`until_done`) that aborts `streams` when it ends, and ends
    (closing the connection) once an output of its streams has waited unread longer than `stall_timeout` (the
    engine's; 0: never): a client that stopped reading then holds nothing."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream], stall_timeout: float) -> None:
        super().__init__(until_done(events, streams), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"}, background=BackgroundTask(abort_all, streams))
        self.streams = streams
        self.timeout = stall_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.timeout <= 0:
            return await super().__call__(scope, receive, send)

        def stalled() -> bool:
            now = time.monotonic()
            return any(s.stalled(self.timeout, now) for s in self.streams)

        async def receive_or_stall() -> dict:  # Starlette ends the response when this says "disconnect"
            msg = asyncio.ensure_future(receive())
            while not msg.done():
                await asyncio.wait({msg}, timeout=min(self.timeout, 1.0))
                if not msg.done() and stalled():
                    msg.cancel()
                    logger.warning("Closing a stream whose client stopped reading (%s)", self.streams[0].request_id)
                    abort_all(self.streams)
                    return {"type": "http.disconnect"}
            return msg.result()

        await super().__call__(scope, receive_or_stall, send)

