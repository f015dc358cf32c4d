"""Reasoning output (--reasoning-parser): what a model thinks between `<think>` and `</think>` is answered apart
from its content, as vLLM does: `message.reasoning_content`, and `delta.reasoning_content` when streamed. The
chat answer (JSON or SSE) is rewritten after the chat path made it, so every API built on it (bridge.py) sees
`reasoning_content` and shows it in its own shape.

deepseek_r1: the template opens the thought, so the output starts inside it (`<think>` optional): everything up to
`</think>` is reasoning, all of it if the output ends first. qwen3: reasoning only if the output starts with
`<think>` (templates skip it when thinking is off), up to `</think>` or the end. Content after `</think>` loses its
leading blank lines. Streamed, a possible start of a tag is held back until it is decided."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse

from pagedlm.sampling.thinking import END, START, ReasoningTags
from pagedlm.server.sse import StreamFailed, chunks


@dataclass(frozen=True)
class ThinkParser:
    opened: bool  # the prompt opened the thought (deepseek_r1) or the output must (qwen3)

    @property
    def tags(self) -> ReasoningTags:
        """The tags and rule a thinking budget needs (sampling/thinking.py)."""
        return ReasoningTags(opened=self.opened)

    def split(self, text: str, final: bool = True) -> tuple[str, str, int]:
        """(reasoning, content, held): of `text`, and when not `final` the characters at its end held back (they
        could still turn into a tag)."""
        body = text.lstrip()
        starts = body.startswith(START)
        if not final and not starts and START.startswith(body):
            return "", "", len(text)  # nothing but the start of a `<think>` yet
        if starts:
            body = body[len(START):]
        elif not self.opened:
            return "", text, 0
        else:
            body = text
        end = body.find(END)
        if end == -1:
            held = 0 if final else _partial(body, END)
            return body[:len(body) - held], "", held
        content = body[end + len(END):].lstrip("\n")
        return body[:end], content, 0


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


REASONING_PARSERS = {"deepseek_r1": lambda: ThinkParser(opened=True), "qwen3": lambda: ThinkParser(opened=False)}


def split_reasoning(response: Response, parser: ThinkParser) -> Response:
    """The chat answer `response` with each choice's reasoning apart from its content."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = _stream(response.body_iterator, parser)
        return response
    body = json.loads(response.body)
    for choice in body.get("choices", []):
        message = choice["message"]
        if message.get("content"):
            reasoning, content, _ = parser.split(message["content"])
            message["reasoning_content"] = reasoning or None
            message["content"] = content or (None if message.get("tool_calls") else "")
    out = Response(json.dumps(body, ensure_ascii=False), status_code=response.status_code,
                   media_type="application/json")
    for k, v in response.headers.items():
        if k.lower() not in ("content-length", "content-type"):
            out.headers[k] = v
    return out


@dataclass
class _Choice:
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0


async def _stream(body: AsyncIterator[str], parser: ThinkParser) -> AsyncIterator[str]:
    states: dict[int, _Choice] = {}
    try:
        async for chunk in chunks(body):
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("role") or ("content" not in delta and choice.get("finish_reason") is None):
                    continue
                st = states.setdefault(choice["index"], _Choice())
                st.text += delta.pop("content", None) or ""
                reasoning, content, _ = parser.split(st.text, final=choice.get("finish_reason") is not None)
                if len(reasoning) > st.reasoning_sent:
                    delta["reasoning_content"] = reasoning[st.reasoning_sent:]
                if len(content) > st.content_sent:
                    delta["content"] = content[st.content_sent:]
                st.reasoning_sent, st.content_sent = max(st.reasoning_sent, len(reasoning)), \
                    max(st.content_sent, len(content))
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    except StreamFailed as e:
        yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.type}})}\n\n"
        yield "data: [DONE]\n\n"
