"""A request's engine streams as the endpoints read them: merging its streams of `EngineOutput` deltas, collecting
each stream's whole `RequestOutput`, aborting on client disconnect, a choice's and a stream's state (what was
sent, usage so far). The engine cuts stop strings and holds back what could still become one: a response only
appends deltas. The SSE response itself is endpoints/render.py's."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from pagedlm.engine.client import RequestStream
from pagedlm.engine.errors import EngineError
from pagedlm.engine.protocol import EngineOutput
from pagedlm.outputs import RequestMetrics, RequestOutput
from pagedlm.sampling.params import SamplingParams
from pagedlm.server.errors import api_error
from pagedlm.server.prediction import prediction_details
from pagedlm.server.protocol import APIError, UsageInfo


@dataclass
class ChoiceState:
    """What a streamed choice needs between its deltas: the echo sent, the completion logprobs' text offset, its
    end; with tools, its text so far and how much of it was sent (calls are parsed from the whole answer)."""

    text_offset: int = 0
    echoed: bool = False
    done: bool = False
    text: str = ""
    sent_chars: int = 0


class StreamUsage:
    """A streamed response's token usage so far: each prompt's tokens once its stream has an output, and every
    generated token; with a prediction, its accepted and rejected tokens (server/prediction.py)."""

    def __init__(self, prompt_lens: list[int], params: SamplingParams | None = None) -> None:
        self.prompt_lens, self.started = prompt_lens, [False] * len(prompt_lens)
        self.completion_tokens = 0
        self.params = params
        self.metrics: list[RequestMetrics | None] = [None] * len(prompt_lens)

    def add(self, i: int, out: EngineOutput) -> None:
        self.started[i] = True
        self.completion_tokens += out.num_new_tokens
        self.metrics[i] = out.metrics or self.metrics[i]

    def info(self) -> UsageInfo:
        prompt = sum(n for n, seen in zip(self.prompt_lens, self.started) if seen)
        return usage_info(prompt, self.completion_tokens, self.params, self.metrics)


def usage_info(prompt: int, completion: int, params: SamplingParams | None,
               metrics: list[RequestMetrics | None]) -> UsageInfo:
    details = None
    if params is not None and params.prediction:
        details = prediction_details(len(params._prediction_token_ids), params.n, metrics)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     completion_tokens_details=details)


def final_usage(outputs: list[RequestOutput | None], params: SamplingParams | None = None) -> UsageInfo:
    """The usage of a whole response: its prompts' requests' outputs, all finished."""
    done = [o for o in outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in done)
    completion = sum(len(c.token_ids) for o in done for c in o.outputs)
    return usage_info(prompt, completion, params, [o.metrics for o in done])


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, EngineOutput]]:
    """The outputs of all streams as (stream index, output), in arrival order; ends when all finished."""
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
    """Each stream's whole output; aborts everything if the client disconnects first. Nothing reaches the client
    before the end (`RequestStream.result`): a lost replica's request may be retried."""
    finals: list[RequestOutput] = [None] * len(streams)  # type: ignore[list-item]

    async def run() -> None:
        for i, out in enumerate(await asyncio.gather(*(s.result() for s in streams))):
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
    """Await `work`; 499 if the client disconnects first; the engine's error (server/errors.py) if it fails it."""

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
    except EngineError as e:
        raise api_error(e) from None
