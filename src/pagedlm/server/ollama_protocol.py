"""Ollama's native API requests (/api/chat, /api/generate, /api/show, /api/embed, /api/embeddings) as pydantic
models, and their translation into the OpenAI request the chat path runs (options to sampling fields, `format` to
a structured-output constraint, tool calls in the history to OpenAI's shape).

Parsed as the OpenAI requests are (strict types, unknown fields named in a response header or refused with
--strict-request-fields). Options that only tune Ollama's runtime (threads, GPU layers, memory mapping) are
accepted and ignored; sampling options this server does not have (mirostat, typical_p, tfs_z, ...) are unknown
fields. Ollama's own defaults for unset options (temperature 0.8, top_k 40, ...) are not applied: unset options
take the server's defaults, as on /v1/chat/completions.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from pagedlm.server.bridge import logprobs_by_id
from pagedlm.server.endpoints.logprobs import Decoder
from pagedlm.server.protocol import WHOLE, APIError, Int, Request

RUNTIME_OPTIONS = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                   "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n")


class Options(Request):
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    num_predict: Int | None = None  # -1: no bound, -2: fill the context (both: until the context is full)
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: Annotated[int, Field(ge=1), WHOLE] | None = None  # at most the model's context (a smaller one: no effect)
    # Ollama's runtime knobs: accepted, no effect here
    numa: bool | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: Int | None = None
    num_keep: Int | None = None
    repeat_last_n: Int | None = None


class FunctionCall(Request):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: Int | None = None


class ToolCall(Request):
    id: str | None = None
    type: str | None = None
    function: FunctionCall


# what the handlers take of fields they check by hand, for /openapi.json: no images, OpenAI's tools
NONE = WithJsonSchema({"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]})
_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": {"type": "string"},
    "parameters": {"type": "object"}}}
_TOOL = {"type": "object", "required": ["function"], "properties": {"type": {"const": "function"},
                                                                     "function": _FUNCTION}}


class Message(Request):
    role: Annotated[str, WithJsonSchema({"enum": ["system", "user", "assistant", "tool"]})]
    content: str | None = ""
    images: Annotated[list[Any] | None, NONE] = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


KeepAlive = str | int | float | None
Format = Literal["", "json"] | dict[str, Any] | None


class _Generating(Request):
    model: str = Field(min_length=1)
    format: Format = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive = None  # accepted, ignored: models stay loaded while the server runs
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token (0-20), with logprobs


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema({"anyOf": [{"type": "array", "items": _TOOL},
                                                                            {"type": "null"}]})] = None


class GenerateRequest(_Generating):
    prompt: str = ""
    suffix: Annotated[str | None, WithJsonSchema({"anyOf": [{"const": ""}, {"type": "null"}]})] = None  # a 400
    system: str | None = None
    template: Annotated[str | None, WithJsonSchema({"anyOf": [{"const": ""}, {"type": "null"}]})] = None  # a 400
    context: Annotated[list[Int] | None, NONE] = None  # a 400
    raw: bool = False
    images: Annotated[list[Any] | None, NONE] = None


class ShowRequest(Request):
    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["model"]}, {"required": ["name"]}]})
    model: str | None = None
    name: str | None = None  # the older field
    verbose: bool = False


class PullRequest(Request):
    model_config = ConfigDict(json_schema_extra={"anyOf": [{"required": ["model"]}, {"required": ["name"]}]})
    model: str | None = None
    name: str | None = None
    insecure: bool = False
    stream: bool = True


class EmbedRequest(Request):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: Int | None = None
    options: Options | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(Request):
    model: str = Field(min_length=1)
    prompt: str
    options: Options | None = None
    keep_alive: KeepAlive = None


NO_IMAGES = "This server's models take no images (`images` is not supported)."


def sampling_fields(options: Options | None, max_model_len: int) -> dict[str, Any]:
    """The OpenAI request fields of Ollama `options`; 400 for a num_ctx beyond the model's context."""
    if options is None:
        return {}
    if options.num_ctx is not None and options.num_ctx > max_model_len:
        raise APIError(400, f"num_ctx {options.num_ctx} exceeds this model's context length ({max_model_len} "
                            "tokens).", param="options.num_ctx")
    out = {"temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
           "min_p": options.min_p, "seed": options.seed, "stop": options.stop,
           "repetition_penalty": options.repeat_penalty, "presence_penalty": options.presence_penalty,
           "frequency_penalty": options.frequency_penalty}
    if options.num_predict is not None and options.num_predict >= 0:
        out["max_tokens"] = options.num_predict
    return {k: v for k, v in out.items() if v is not None}


def logprob_fields(req: _Generating, raw: bool) -> dict[str, Any]:
    """`logprobs` / `top_logprobs` as the chat request's (`raw`: the completion request's) fields; 400 in Ollama's
    words for a top_logprobs outside 0-20."""
    k = req.top_logprobs or 0
    if not 0 <= k <= 20:
        raise APIError(400, "top_logprobs must be between 0 and 20", param="top_logprobs")
    if not req.logprobs:
        return {}
    return {"logprobs": k, "return_tokens_as_token_ids": True} if raw else {"logprobs": True, "top_logprobs": k}


def logprobs(choice: dict[str, Any], k: int, tok: Decoder) -> list[dict[str, Any]] | None:
    """An OpenAI choice's logprobs as Ollama's `[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`:
    a chat choice's are that already; a completion's (asked by token id: logprob_fields) are rebuilt with `tok`, the
    `k` alternatives highest first."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    if "content" in lp:
        return lp["content"] or None
    strip = ("token", "logprob", "bytes")
    return [{**{f: e[f] for f in strip}, "top_logprobs": [{f: t[f] for f in strip} for t in e["top_logprobs"]]}
            for e in logprobs_by_id(tok, lp, k)] or None


def format_fields(fmt: Format) -> dict[str, Any]:
    """`format` as OpenAI's response_format: "json" any JSON object, a JSON schema that schema."""
    if not fmt:
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama messages as OpenAI's: tool calls with their arguments, tool results naming their tool."""
    out = []
    for m in messages:
        if m.images:
            raise APIError(400, NO_IMAGES, param="messages")
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id or f"call_{i}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for i, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            msg["name"] = m.tool_name
        out.append(msg)
    return out


def tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    if not calls:
        return None
    out = []
    for i, c in enumerate(calls):
        fn = c["function"]
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {}
        out.append({"id": c.get("id"), "function": {"index": i, "name": fn["name"],
                                                    "arguments": args if isinstance(args, dict) else {}}})
    return out
