"""OpenAI's Responses API: POST /v1/responses (a response object, or its SSE events: response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta / .done,
response.function_call_arguments.delta / .done, response.output_item.done, response.completed or
response.incomplete), and GET / DELETE /v1/responses/{id} over the per-key store (response_store.py) that
`previous_response_id` continues from. Generation runs through the chat path (bridge.py), logprobs too (the chat
answer's, in the output text and its delta events); errors are OpenAI's."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedlm.server import responses_protocol as R
from pagedlm.server.bridge import Bridge, answer, reply, restream, streaming
from pagedlm.server.protocol import APIError
from pagedlm.server.response_store import ResponseStore, StoredResponse
from pagedlm.server.sse import StreamFailed, chunks


def add_responses_routes(app: FastAPI, bridge: Bridge, store: ResponseStore) -> None:
    api = ResponsesAPI(bridge, store)
    app.post("/v1/responses")(api.create)
    app.get("/v1/responses/{rid}")(api.retrieve)
    app.delete("/v1/responses/{rid}")(api.delete)


class ResponsesAPI:
    def __init__(self, bridge: Bridge, store: ResponseStore) -> None:
        self.bridge, self.store = bridge, store

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        req, unknown = await self.bridge.parse(request, R.ResponsesRequest)
        key = _key(request)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = self.store.conversation(key, req.previous_response_id)
            if isinstance(history, str):
                prev = f"Previous response with id '{req.previous_response_id}'"
                what = f"{prev} not found" if history == req.previous_response_id else \
                    f"{prev} continues response '{history}', which was not found"
                raise APIError(404, f"{what} (stored responses live in this server's memory, for a limited time).",
                               param="previous_response_id", code="previous_response_not_found")
        new = R.input_messages(req.input)
        if not new:
            raise APIError(400, "The input is empty.", param="input")
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        body = {"model": req.model, "messages": [*system, *history, *new], **R.chat_fields(req),
                "stream": req.stream, "user": req.user}
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        response = await self.bridge.chat(request, {k: v for k, v in body.items() if v is not None}, arrival)
        turn = Turn(self, req, key, new)
        if streaming(response):
            return restream(response, turn.events(response.body_iterator), "text/event-stream", unknown)
        out = answer(response)
        choice = out["choices"][0]
        message = choice["message"]
        output = [R.reasoning_item(R.item_id("rs"), message["reasoning_content"])] \
            if message.get("reasoning_content") else []
        lps = (choice.get("logprobs") or {}).get("content") if R.wants_logprobs(req) else None
        output += [R.message_item(R.item_id("msg"), message["content"], logprobs=lps)] if message.get("content") \
            else []
        output += [R.call_item(R.item_id("fc"), c) for c in message.get("tool_calls") or []]
        return reply(response, turn.finish(output, choice["finish_reason"], out["usage"]), unknown)

    async def retrieve(self, request: Request, rid: str) -> Response:
        entry = self.store.get(_key(request), rid)
        if entry is None:
            raise _not_found(rid)
        return JSONResponse(entry.response)

    async def delete(self, request: Request, rid: str) -> Response:
        if not self.store.delete(_key(request), rid):
            raise _not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})


class Turn:
    """One response being made: its object and, once finished, its place in the store."""

    def __init__(self, api: ResponsesAPI, req: R.ResponsesRequest, key: str, new: list[dict[str, Any]]) -> None:
        self.api, self.req, self.key, self.new = api, req, key, new
        self.id, self.created = R.item_id("resp"), int(time.time())
        self.model = req.model or api.bridge.front.default.name  # none named: the first served, which answers

    def object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "previous_response_id": req.previous_response_id,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
                "max_output_tokens": req.max_output_tokens, "text": {"format": fmt}, "store": req.store,
                "truncation": req.truncation or "disabled", "metadata": req.metadata or {}, "user": req.user,
                "usage": _usage(usage) if usage is not None else None}

    def finish(self, output: list[dict[str, Any]], finish: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """The final object; stored (with this turn's input and output as messages) when the request asks."""
        if finish == "length" and output and output[-1]["type"] == "message":
            output[-1]["status"] = "incomplete"  # the message max_output_tokens cut
        obj = self.object("incomplete" if finish == "length" else "completed", output, usage)
        if self.req.store:
            self.api.store.put(self.key, self.id, StoredResponse(obj, [*self.new, *R.output_messages(output)],
                                                                 self.req.previous_response_id, time.monotonic()))
        return obj

    async def events(self, body: AsyncIterator[str]) -> AsyncIterator[str]:
        seq = EventCounter()
        yield seq.event("response.created", response=self.object("in_progress", []))
        yield seq.event("response.in_progress", response=self.object("in_progress", []))
        output: list[dict[str, Any]] = []
        text, text_item, text_index, finish, usage = "", None, 0, None, {}
        thinking, thought, thought_index = "", None, 0
        lps = TextLogprobs()
        try:
            async for chunk in chunks(body):
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    delta = c.get("delta", {})
                    finish = c.get("finish_reason") or finish
                    lps.add(c)
                    if delta.get("reasoning_content"):
                        if thought is None:
                            thought = R.reasoning_item(R.item_id("rs"), "", "in_progress")
                            thought_index = len(output)
                            output.append(thought)
                            yield seq.event("response.output_item.added", output_index=thought_index,
                                            item=dict(thought))
                        thinking += delta["reasoning_content"]
                        yield seq.event("response.reasoning_text.delta", item_id=thought["id"],
                                        output_index=thought_index, content_index=0, delta=delta["reasoning_content"])
                    if thought is not None and thought["status"] != "completed" and (
                            delta.get("content") or delta.get("tool_calls") or c.get("finish_reason")):
                        thought.update(R.reasoning_item(thought["id"], thinking))
                        yield seq.event("response.reasoning_text.done", item_id=thought["id"],
                                        output_index=thought_index, content_index=0, text=thinking)
                        yield seq.event("response.output_item.done", output_index=thought_index, item=thought)
                    if delta.get("content"):
                        if text_item is None:
                            text_item = R.message_item(R.item_id("msg"), "", "in_progress")
                            text_index = len(output)
                            output.append(text_item)
                            yield seq.event("response.output_item.added", output_index=text_index,
                                            item=dict(text_item))
                            yield seq.event("response.content_part.added", item_id=text_item["id"],
                                            output_index=text_index, content_index=0, part=R.output_text(""))
                        text += delta["content"]
                        yield seq.event("response.output_text.delta", item_id=text_item["id"],
                                        output_index=text_index, content_index=0,
                                        delta=delta["content"], logprobs=lps.take())
                    for call in delta.get("tool_calls") or []:
                        for ev in _close_text(seq, text_index, text_item, text, lps.all):
                            yield ev
                        text_item = None
                        for ev in _call_events(seq, output, call):
                            yield ev
        except StreamFailed as e:
            error = {"code": "server_error", "message": e.message}
            yield seq.event("response.failed", response=self.object("failed", output, usage, error))
            return
        for ev in _close_text(seq, text_index, text_item, text, lps.all, "incomplete" if finish == "length" else
                              "completed"):
            yield ev
        final = self.finish(output, finish, usage)
        yield seq.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                        response=final)

class TextLogprobs:
    """The logprobs of a streamed answer's tokens (its chunks' `logprobs.content`, when the request asked): each
    text delta carries those that came since the previous one (a chat chunk carries the tokens whose text it
    carries, endpoints/logprobs.TextTokens, the last one also those whose text a stop string cut), the done events
    all of them."""

    def __init__(self) -> None:
        self.all: list[dict[str, Any]] = []
        self._sent = 0

    def add(self, choice: dict[str, Any]) -> None:
        self.all += (choice.get("logprobs") or {}).get("content") or []

    def take(self) -> list[dict[str, Any]]:
        new, self._sent = self.all[self._sent:], len(self.all)
        return new


def _close_text(seq: EventCounter, index: int, item: dict[str, Any] | None, text: str,
                logprobs: list[dict[str, Any]], status: str = "completed") -> list[str]:
    """The events that end the message item `item` (at `output[index]`) with its whole `text` (and `logprobs`),
    `status` "completed", or "incomplete" where max_output_tokens cut it."""
    if item is None or item["status"] != "in_progress":
        return []
    item.update(R.message_item(item["id"], text, status, logprobs))
    return [seq.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text, logprobs=logprobs),
            seq.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=R.output_text(text, logprobs)),
            seq.event("response.output_item.done", output_index=index, item=item)]


def _call_events(seq: EventCounter, output: list[dict[str, Any]], call: dict[str, Any]) -> list[str]:
    iid = R.item_id("fc")
    item, index = R.call_item(iid, call, "in_progress"), len(output)
    output.append(item)
    done = R.call_item(iid, call)
    events = [seq.event("response.output_item.added", output_index=index, item=dict(item)),
              seq.event("response.function_call_arguments.delta", item_id=iid, output_index=index,
                        delta=done["arguments"]),
              seq.event("response.function_call_arguments.done", item_id=iid, output_index=index,
                        arguments=done["arguments"], name=done["name"])]
    item.update(done)
    events.append(seq.event("response.output_item.done", output_index=index, item=item))
    return events


class EventCounter:
    """Numbers a stream's events (`sequence_number`) and writes them as SSE."""

    def __init__(self) -> None:
        self.n = 0

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.n, **data}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _key(request: Request) -> str:
    return getattr(request.state, "api_key", None) or ""


def _not_found(rid: str) -> APIError:
    return APIError(404, f"No response with id '{rid}' (stored responses live in this server's memory, for a "
                         "limited time).", param="response_id", code="not_found")
