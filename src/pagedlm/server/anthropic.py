"""Anthropic's Messages API: POST /v1/messages (a message, or its SSE events: message_start,
content_block_start / content_block_delta / content_block_stop per text or tool_use block, message_delta,
message_stop) and POST /v1/messages/count_tokens. The key may come as `x-api-key` (middleware.py); errors are
Anthropic's `{"type": "error", "error": {...}}` (api_errors.py). Generation runs through the chat path (bridge.py)
with every check and limit of /v1/chat/completions."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedlm.server import anthropic_protocol as A
from pagedlm.server import protocol as P
from pagedlm.server.api_errors import anthropic_error
from pagedlm.server.bridge import Bridge, answer, chat_request, reply, restream, streaming
from pagedlm.server.protocol import APIError
from pagedlm.server.sse import StreamFailed, chunks


def add_anthropic_routes(app: FastAPI, bridge: Bridge) -> None:
    api = AnthropicAPI(bridge)
    app.post("/v1/messages")(api.messages)
    app.post("/v1/messages/count_tokens")(api.count_tokens)


class AnthropicAPI:
    def __init__(self, bridge: Bridge) -> None:
        self.bridge, self.front = bridge, bridge.front

    async def messages(self, request: Request) -> Response:
        arrival = time.monotonic()
        req, unknown = await self.bridge.parse(request, A.MessagesRequest)
        body = {**A.chat_fields(req), "max_tokens": req.max_tokens, "stop": req.stop_sequences,
                "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream}
        if req.output_config is not None and req.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": req.output_config.format.schema_}}
        if req.thinking is not None:  # templates take enable_thinking; budget_tokens needs a reasoning parser
            body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
            if req.thinking.type == "enabled" and self.front.reasoning is not None:
                body["thinking_token_budget"] = req.thinking.budget_tokens
        if req.stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        response = await self.bridge.chat(request, {k: v for k, v in body.items() if v is not None}, arrival)
        mid = f"msg_{uuid.uuid4().hex}"
        if streaming(response):
            return restream(response, self._events(response.body_iterator, req, mid), "text/event-stream", unknown)
        out = answer(response)
        choice = out["choices"][0]
        message = choice["message"]
        content = [_thinking(message["reasoning_content"])] if message.get("reasoning_content") else []
        content += [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [_tool_use(c) for c in message.get("tool_calls") or []]
        reason, sequence = A.stop_reason(choice["finish_reason"], choice.get("stop_reason"), req.stop_sequences)
        return reply(response, {**_message(mid, req.model, content), "stop_reason": reason,
                                "stop_sequence": sequence, "usage": _usage(out["usage"])}, unknown)

    async def count_tokens(self, request: Request) -> Response:
        req, unknown = await self.bridge.parse(request, A.CountTokensRequest)
        chat = chat_request(A.chat_fields(req), P.ChatCompletionRequest)
        chat.check_supported()
        if self.front.is_auto(chat.model):
            raise APIError(400, "Count tokens with a served model's name (the router's models tokenize "
                                "differently).", param="model")
        srv = self.front.model(chat.model)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools_active else None
        ids = await self.front.stages.run("chat", srv.chat_request_prompt, chat, tools)  # a prefill's open turn too
        return reply(JSONResponse({}), {"input_tokens": len(ids)}, unknown)

    async def _events(self, body: AsyncIterator[str], req: A.MessagesRequest, mid: str) -> AsyncIterator[str]:
        """Anthropic's events of an OpenAI chat stream. message_start waits for the first chunk that carries the
        prompt's token count (continuous usage); text is one block, each tool call a tool_use block after it."""
        started, block, finish, matched, usage = False, None, None, None, {}
        index = 0
        try:
            async for chunk in chunks(body):
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    delta = c.get("delta", {})
                    text, calls = delta.get("content"), delta.get("tool_calls")
                    thinking = delta.get("reasoning_content")
                    finish = c.get("finish_reason") or finish
                    matched = c.get("stop_reason") if c.get("finish_reason") else matched
                    if not (text or calls or thinking or finish):
                        continue
                    if not started:
                        started = True
                        yield _event("message_start", {"message": {
                            **_message(mid, req.model, []), "stop_reason": None, "stop_sequence": None,
                            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}}})
                    if thinking:
                        if block is None:
                            block = "thinking"
                            yield _event("content_block_start", {"index": index, "content_block": _thinking("")})
                        yield _event("content_block_delta", {"index": index, "delta": {
                            "type": "thinking_delta", "thinking": thinking}})
                    if text:
                        if block == "thinking":
                            yield _event("content_block_stop", {"index": index})
                            index, block = index + 1, None
                        if block is None:
                            block = "text"
                            yield _event("content_block_start", {"index": index,
                                                                 "content_block": {"type": "text", "text": ""}})
                        yield _event("content_block_delta", {"index": index,
                                                             "delta": {"type": "text_delta", "text": text}})
                    for call in calls or []:
                        if block is not None:
                            yield _event("content_block_stop", {"index": index})
                            index += 1
                        block = "tool_use"
                        use = _tool_use(call)
                        yield _event("content_block_start", {"index": index,
                                                             "content_block": {**use, "input": {}}})
                        yield _event("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": json.dumps(use["input"])}})
        except StreamFailed as e:
            yield _event("error", anthropic_error(APIError(500, e.message, type=e.type)))
            return
        if not started:
            yield _event("message_start", {"message": {
                **_message(mid, req.model, []), "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}}})
        if block is not None:
            yield _event("content_block_stop", {"index": index})
        reason, sequence = A.stop_reason(finish, matched, req.stop_sequences)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": _usage(usage)})
        yield _event("message_stop", {})


def _message(mid: str, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content}


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "name": fn["name"],
            "input": A.tool_input(fn.get("arguments") or "{}")}


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}


def _event(kind: str, data: dict[str, Any]) -> str:
    payload = data if kind == "error" else {"type": kind, **data}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
