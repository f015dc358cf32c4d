"""Results as HTTP responses: an `Answer` as one JSON body, a `Stream` as SSE (`data:` events, then `[DONE]`; an
engine failure ends it with its OpenAI error event). `replay` turns a whole answer into the chunks a stream of it
would have had (the cascade's answer, when the client asked for a stream)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from pagedlm.engine.client import RequestStream
from pagedlm.engine.errors import EngineError
from pagedlm.server import protocol as P
from pagedlm.server.endpoints.results import Answer, Chunk, Result, Stream
from pagedlm.server.errors import api_error
from pagedlm.server.protocol import APIError
from pagedlm.server.streaming import abort_all
from pagedlm.server.wire import json_response

logger = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def render(result: Result) -> Response:
    if isinstance(result, Answer):
        return json_response(result.body)
    return EventStream(_events(result.chunks), result.streams, result.stall_timeout)


def event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def event_error(e: APIError) -> str:
    return f"data: {json.dumps(e.body())}\n\n"


async def _events(chunks: AsyncIterator[Chunk]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield event(chunk)


async def until_done(events: AsyncIterator[str], streams: list[RequestStream]) -> AsyncIterator[str]:
    """`events`, then `[DONE]`; an engine failure (or an APIError once the stream started, e.g. a full render
    stage) ends them early with an error event and `[DONE]`. The streams are aborted at the end."""
    try:
        async for ev in events:
            yield ev
        yield DONE
    except (EngineError, APIError) as e:
        yield event_error(api_error(e) if isinstance(e, EngineError) else e)
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


def replay(answer: Answer, req: P.CompletionRequest | P.ChatCompletionRequest) -> Stream:
    """`answer` (one choice, complete) as a stream's chunks: chat's role, content and finish chunks, a
    completion's one chunk; then the usage chunk if the request asked for it."""
    return Stream(_replay_chunks(answer, req))


async def _replay_chunks(answer: Answer, req: P.CompletionRequest | P.ChatCompletionRequest) -> AsyncIterator[Chunk]:
    body = answer.body
    usage = body.usage
    head = {"id": body.id, "created": body.created, "model": body.model}
    running_usage = usage if req.continuous_usage and req.include_usage else None
    if answer.chat:
        (c,) = body.choices
        for choice in (P.ChatStreamChoice(index=0, delta=P.DeltaMessage(role="assistant", content="")),
                       P.ChatStreamChoice(index=0, delta=P.DeltaMessage(content=c.message.content),
                                          logprobs=c.logprobs),
                       P.ChatStreamChoice(index=0, delta=P.DeltaMessage(), finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason)):
            yield P.ChatCompletionChunk(**head, choices=[choice], usage=running_usage)
        if req.include_usage:
            yield P.ChatCompletionChunk(**head, choices=[], usage=usage)
    else:
        yield P.CompletionResponse(**head, choices=body.choices, usage=running_usage)
        if req.include_usage:
            yield P.CompletionResponse(**head, choices=[], usage=usage)
