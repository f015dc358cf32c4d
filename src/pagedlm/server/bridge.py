"""Other APIs over the OpenAI path: a request of Ollama's, Anthropic's or the Responses API is translated into a
`ChatCompletionRequest` (or a `CompletionRequest`) and run by `Frontend.chat` / `Frontend.complete`, so that every
check, limit, route and engine feature of /v1/chat/completions applies to it; its OpenAI answer is then read back
for translation: the JSON of a complete answer, or the chunks of its SSE stream, whose response object is kept
(with its abort-on-disconnect and stall handling) and given the translated body."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pagedlm.server import protocol as P
from pagedlm.server.endpoints.logprobs import Decoder
from pagedlm.server.frontend import Frontend, flag_unknown
from pagedlm.server.protocol import APIError
from pagedlm.server.wire import parse_request

T = TypeVar("T", bound=BaseModel)
_HEADERS = ("x-pagedlm-", "retry-after")  # response headers an answer keeps through translation


class Bridge:
    """What a translating API needs of the app: its `Frontend` (models, routing, stages, strictness)."""

    def __init__(self, front: Frontend) -> None:
        self.front = front

    async def parse(self, request: Request, model: type[T]) -> tuple[T, list[str]]:
        """The body as the API's own request `model` (parse stage, 400 naming the field), with its unknown fields
        (a 400 with --strict-request-fields)."""
        if self.front.draining:
            raise P.shutting_down()
        req = await parse_request(request, model, self.front.stages)
        return req, self.front.unknown_fields(req)

    async def chat(self, request: Request, body: dict[str, Any], arrival: float) -> Response:
        """`body` (an OpenAI chat request, built by a translator) run as /v1/chat/completions runs it."""
        return await self.front.chat(request, chat_request(body, P.ChatCompletionRequest), arrival)

    async def complete(self, request: Request, body: dict[str, Any], arrival: float) -> Response:
        return await self.front.complete(request, chat_request(body, P.CompletionRequest), arrival)


def chat_request(body: dict[str, Any], model: type[T]) -> T:
    """A translated request as the OpenAI request `model`; 400 naming the field for a value it refuses."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()) if not isinstance(x, int)) or "body"
        raise APIError(400, f"Invalid value for `{where}`: {err['msg']}", param=where.split(".")[0]) from None


def prefill(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat fields that continue a conversation's last message where it is the assistant's text (a prefill, as
    Anthropic's and Ollama's APIs read one): its turn left open, no generation prompt."""
    last = messages[-1] if messages else {}
    text = last.get("content")
    if last.get("role") == "assistant" and not last.get("tool_calls") and isinstance(text, str) and text.strip():
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {}


def answer(response: Response) -> dict[str, Any]:
    """The JSON body of a complete (not streamed) OpenAI answer."""
    return json.loads(response.body)


def restream(response: StreamingResponse, body: AsyncIterator[str], media_type: str,
             unknown: list[str] = ()) -> StreamingResponse:
    """The OpenAI stream `response` with `body` (translated from its `chunks`) as its body and `media_type`."""
    response.body_iterator = body
    response.media_type = media_type
    response.headers["content-type"] = media_type
    return flag_unknown(response, list(unknown))


def reply(source: Response, content: Any, unknown: list[str] = (), status: int = 200) -> Response:
    """A translated complete answer (JSON), with the routing headers of the OpenAI answer it came from."""
    out = Response(json.dumps(content, ensure_ascii=False), status_code=status, media_type="application/json")
    for k, v in source.headers.items():
        if k.startswith(_HEADERS):
            out.headers[k] = v
    return flag_unknown(out, list(unknown))


def streaming(response: Response) -> bool:
    return isinstance(response, StreamingResponse)


def logprobs_by_id(tok: Decoder, lp: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """A completion's logprobs asked with `return_tokens_as_token_ids` as `[{id, token, bytes, logprob,
    top_logprobs: [{id, token, bytes, logprob}]}]`, the `k` likeliest alternatives first: by id, tokens whose texts
    are equal stay apart, and each carries its own bytes."""
    def entry(key: str, logprob: float) -> dict[str, Any]:
        tid = int(key.removeprefix("token_id:"))
        return {"id": tid, "token": tok.decode([tid], skip_special_tokens=False),
                "bytes": list(tok.token_bytes(tid)), "logprob": logprob}

    out = []
    for key, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        best = sorted((top or {}).items(), key=lambda kv: -kv[1])[:k]
        out.append({**entry(key, value), "top_logprobs": [entry(t, v) for t, v in best]})
    return out


def now_ns() -> int:
    return time.monotonic_ns()
