"""Anthropic's Messages API requests (/v1/messages, /v1/messages/count_tokens) as pydantic models, and their
translation into the OpenAI chat request the chat path runs: the system prompt as a system message, `tool_use`
blocks as assistant tool calls, `tool_result` blocks as tool messages, `tool_choice` as OpenAI's. Images,
documents and Anthropic's server tools (web search, code execution, ...) are refused with a 400."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from pagedlm.server.bridge import prefill
from pagedlm.server.protocol import MAX_TOOLS, WHOLE, APIError, Request


def _block(kind: str, *required: str, **properties: Any) -> dict[str, Any]:
    """The JSON schema of a content block of type `kind` (/openapi.json; the blocks are read by hand below)."""
    return {"type": "object", "properties": {"type": {"const": kind}, **properties}, "required": ["type", *required]}


_TEXT = _block("text", "text", text={"type": "string"})
_THINKING = {"type": "object", "properties": {"type": {"enum": ["thinking", "redacted_thinking"]}},
             "required": ["type"]}
_TOOL_USE = _block("tool_use", "name", id={"type": "string"}, name={"type": "string"}, input={"type": "object"})
_TOOL_RESULT = _block("tool_result", "tool_use_id", tool_use_id={"type": "string"},
                      content={"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT}]})


def _content(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": list(blocks)}}]}


class Message(Request):
    # the blocks each role may send: text and thinking; a user's tool results, an assistant's tool uses
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "user"}, "content": _content(_TEXT, _TOOL_RESULT, _THINKING)}},
        {"properties": {"role": {"const": "assistant"}, "content": _content(_TEXT, _TOOL_USE, _THINKING)}}]})
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    # "custom" (or none): a client tool; anything else is a server tool (a 400)
    type: Annotated[str | None, WithJsonSchema({"anyOf": [{"const": "custom"}, {"type": "null"}]})] = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Request):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None


class OutputFormat(Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Request):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted, no effect


class _Conversation(Request):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | Annotated[list[dict[str, Any]], WithJsonSchema({"type": "array", "items": _TEXT})] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(_Conversation):
    max_tokens: Annotated[int, Field(ge=1), WHOLE]
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=0), WHOLE] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(_Conversation):
    pass


def chat_fields(req: _Conversation) -> dict[str, Any]:
    """The OpenAI chat fields of a conversation: messages, tools, tool_choice, parallel_tool_calls."""
    messages = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _messages(m, f"messages[{i}]")
    out: dict[str, Any] = {"model": req.model, "messages": messages, **prefill(messages)}
    if req.tools:
        for t in req.tools:
            if t.type not in (None, "custom"):
                raise APIError(400, f"Server tools ({t.type}) are not supported: give client tools (name, "
                                    "description, input_schema).", param="tools")
        out["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice of type `tool` needs a name.", param="tool_choice")
        out["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def _messages(m: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: a user turn's tool results become tool messages (before its
    text), an assistant turn's tool_use blocks its tool calls; thinking blocks are not part of the prompt."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for block in m.content:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{where}: a tool_use block needs a name and an input object.", param="messages")
            calls.append({"id": str(block.get("id") or f"toolu_{len(calls)}"), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and m.role == "user":
            content = block.get("content")
            text = content if isinstance(content, str) else _text(content or [], where)
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind in ("image", "document", "search_result"):
            raise APIError(400, f"{where}: {kind} blocks are not supported (this server's models read text).",
                           param="messages")
        else:
            raise APIError(400, f"{where}: unsupported content block {kind!r} for role {m.role}.", param="messages")
    out = results
    if texts or calls:
        msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out = [*out, msg]
    return out


def _text(value: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(value, str):
        return value
    parts = []
    for block in value if isinstance(value, list) else [value]:
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}: only text blocks are supported here, got {kind!r}.",
                           param=where.split("[")[0])
        parts.append(block["text"])
    return "\n".join(parts)


def stop_reason(finish: str | None, matched: int | str | None, stops: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of an OpenAI finish_reason and the stop it matched."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stops or []):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
