"""OpenAI's Responses API requests (POST /v1/responses) as a pydantic model, their input items as OpenAI chat
messages (messages, function calls and their outputs), their tools, tool_choice, text.format and logprobs
(`include` and `top_logprobs`) as the chat request's fields, and the output items of a chat answer."""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema

from pagedlm.server.protocol import MAX_TOOLS, WHOLE, APIError, Request

# JSON schemas of what `input_messages` and `chat_fields` read by hand (for /openapi.json)
_STR = {"type": "string"}
_PARTS = {"anyOf": [_STR, {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": _STR}}}]}
_INPUT_ITEM = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": _PARTS}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": _STR, "name": _STR, "arguments": _STR}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": _STR, "output": _PARTS}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}}]}
_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
    "description": _STR, "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
_NAMED_CHOICE = {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                                "name": _STR}}


class TextFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=256)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Request):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, no effect


class ResponsesRequest(Request):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], WithJsonSchema({"type": "array", "items": _INPUT_ITEM})]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], WithJsonSchema({"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS})] \
        | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | Annotated[dict[str, Any], WithJsonSchema(_NAMED_CHOICE)] | \
        None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=128)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # "message.output_text.logprobs": the output text's logprobs; others ignored
    top_logprobs: int | None = Field(None, ge=0, le=20)  # alternatives per token, with those logprobs
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: none or minimal turns a template's thinking off
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as OpenAI chat messages: function calls join the assistant turn before them (or open one),
    their outputs become tool messages; reasoning items are not part of the prompt."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}: unknown role {role!r}.", param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings).",
                               param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise APIError(400, f"{where}: a function_call_output needs call_id and output.", param="input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _content(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (messages, function_call, "
                                "function_call_output).", param="input")
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts.", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{where}: {kind} is not supported (this server's models read text).",
                           param="input")
        else:
            raise APIError(400, f"{where}: unsupported content part {kind!r}.", param="input")
    return "".join(parts)


def chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The chat request fields of tools, tool_choice, text.format and the sampling options."""
    out: dict[str, Any] = {"max_tokens": req.max_output_tokens, "temperature": req.temperature,
                           "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        for t in req.tools:
            if t.get("type") != "function":
                raise APIError(400, f"Tools of type {t.get('type')!r} are not supported: give function tools.",
                               param="tools")
        out["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                            "strict") if t.get(k) is not None}}
                        for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\"}.",
                           param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    out["tool_choice"] = choice
    if wants_logprobs(req):  # the chat answer's logprobs are OpenAI's Responses shape already
        out["logprobs"], out["top_logprobs"] = True, req.top_logprobs or 0
    if req.reasoning is not None:
        out["chat_template_kwargs"] = {"enable_thinking": req.reasoning.get("effort") not in ("none", "minimal")}
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        out["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format json_schema needs a schema.", param="text")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                         "schema": fmt.schema_}}
    return {k: v for k, v in out.items() if v is not None}


LOGPROBS = "message.output_text.logprobs"


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the output text carries logprobs: `include` asks for them (`top_logprobs` alone does not)."""
    return LOGPROBS in (req.include or ())


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(iid: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [output_text(text, logprobs)] if status != "in_progress" else []}


def reasoning_item(iid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": iid, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output_text content part; `logprobs`: its tokens' ({token, logprob, bytes, top_logprobs}, as a chat
    answer's `logprobs.content`)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(iid: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": iid, "call_id": call.get("id") or iid, "name": fn["name"],
            "arguments": fn.get("arguments") or "" if status == "completed" else "", "status": status}


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation replays."""
    return input_messages([{k: v for k, v in item.items() if k in ("type", "role", "content", "call_id", "name",
                                                                   "arguments")}
                           for item in output if item["type"] in ("message", "function_call")])
