"""/openapi.json: FastAPI's description of the routes, plus the request bodies the POST routes parse themselves
(wire.parse_request, for their 400s) as their models' JSON schemas, fitted to this server: a body's `model` names
the models that route serves, token counts (max_tokens, ...) stop at the longest context served, token ids at the
vocabulary, prompts and inputs are not empty, and `priority` is 0 unless clients may set it. Clients and fuzzers
(schemathesis) see what the handlers take, so that the bodies they make reach them."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedlm.server import anthropic_protocol as A
from pagedlm.server import ollama_protocol as O
from pagedlm.server import protocol as P
from pagedlm.server import responses_protocol as R
from pagedlm.server.embeddings import EmbeddingRequest
from pagedlm.server.endpoints.base import TEMPLATE_KWARGS
from pagedlm.server.llamacpp import CompletionRequest as LlamaCppCompletion

# each route's body, and which names its `model` takes: generation models and the auto model ("auto"), the
# served generation models alone ("served"), or the embedding models ("embedding")
BODIES: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/completions": (P.CompletionRequest, "auto"), "/v1/chat/completions": (P.ChatCompletionRequest, "auto"),
    "/tokenize": (P.TokenizeRequest, "served"), "/detokenize": (P.DetokenizeRequest, "served"),
    "/api/chat": (O.ChatRequest, "auto"), "/api/generate": (O.GenerateRequest, "auto"),
    "/api/show": (O.ShowRequest, "served"), "/api/pull": (O.PullRequest, "served"),
    "/v1/messages": (A.MessagesRequest, "auto"),
    "/v1/messages/count_tokens": (A.CountTokensRequest, "served"), "/v1/responses": (R.ResponsesRequest, "auto"),
    "/v1/embeddings": (EmbeddingRequest, "embedding"), "/api/embed": (O.EmbedRequest, "embedding"),
    "/api/embeddings": (O.EmbeddingsRequest, "embedding"), "/completion": (LlamaCppCompletion, "auto"),
}
# the schemas of other APIs share class names with OpenAI's (Message, Tool, ...): theirs get a prefix
PREFIXES = {O.__name__: "Ollama", A.__name__: "Anthropic", R.__name__: "Responses",
            LlamaCppCompletion.__module__: "LlamaCpp"}
# at most the context
TOKEN_COUNTS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_ctx", "n_predict")
# per route, fields of token ids (of the generation or the embedding models' vocabulary) and fields not empty
TOKEN_IDS = {"/v1/completions": {"prompt": "generation", "allowed_token_ids": "generation",
                                 "stop_token_ids": "generation"},
             "/v1/chat/completions": {"allowed_token_ids": "generation", "stop_token_ids": "generation"},
             "/detokenize": {"tokens": "generation"}, "/v1/embeddings": {"input": "embedding"},
             "/completion": {"prompt": "generation"}}
NOT_EMPTY = {"/v1/completions": "prompt", "/v1/embeddings": "input", "/api/embed": "input",
             "/api/embeddings": "prompt", "/v1/responses": "input", "/completion": "prompt"}


@dataclass(frozen=True)
class Served:
    """What the server serves, as the bodies' schemas name it."""

    models: Sequence[str]  # generation models
    auto: str | None  # the auto model's name (None: no router)
    embedders: Sequence[str]
    max_model_len: int  # the longest context of the generation models
    vocab_size: int  # the smallest vocabulary of the generation models
    embedding_vocab_size: int | None  # of the embedding models (None: none served)
    client_priority: bool  # requests may set `priority`

    def names(self, kind: str) -> list[str]:
        if kind == "embedding":
            return list(self.embedders)
        return [*self.models, *([self.auto] if kind == "auto" and self.auto else [])]


def document_bodies(app: FastAPI, served: Served) -> None:
    """Describe BODIES in the app's /openapi.json (built on first use)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, (model, kind) in BODIES.items():
                name = PREFIXES.get(model.__module__, "") + model.__name__
                body = _schema(model)
                for prop in ("model", "name") if model is O.ShowRequest else ("model",):
                    _name_models(body["properties"], prop, served.names(kind))
                _fit(path, body["properties"], served)
                defs = body.pop("$defs", {})
                for part in (body, *defs.values()):
                    for prop in TOKEN_COUNTS:
                        _bound(part.get("properties", {}).get(prop), served.max_model_len)
                components.update(defs)
                components[name] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema, its definitions (and the references to them) prefixed as PREFIXES has it."""
    prefix = PREFIXES.get(model.__module__, "")
    body = model.model_json_schema(ref_template=f"#/components/schemas/{prefix}{{model}}")
    if "$defs" in body:
        body["$defs"] = {prefix + k: v for k, v in body["$defs"].items()}
    return body


def _fit(path: str, properties: dict[str, Any], served: Served) -> None:
    """The route's token ids within their vocabulary, its prompt or input not empty, `priority` 0 unless allowed,
    chat_template_kwargs as the endpoint takes them."""
    for prop, kind in TOKEN_IDS.get(path, {}).items():
        vocab = served.vocab_size if kind == "generation" else served.embedding_vocab_size
        for branch in _walk(properties.get(prop)) if vocab else ():
            if branch.get("type") == "integer":
                branch.update(minimum=0, maximum=vocab - 1)
    for branch in _walk(properties.get(NOT_EMPTY.get(path, ""))):
        if branch.get("type") in ("string", "array"):
            branch["minLength" if branch["type"] == "string" else "minItems"] = 1
    if "priority" in properties and not served.client_priority:
        properties["priority"] = {"type": "integer", "const": 0}
    if "chat_template_kwargs" in properties:
        for branch in _branches(properties["chat_template_kwargs"]):
            if branch.get("type") == "object":
                branch["propertyNames"] = {"enum": sorted(TEMPLATE_KWARGS)}


def _walk(schema: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """`schema` and every schema inside it (anyOf branches, array items)."""
    if schema:
        yield schema
        for branch in schema.get("anyOf", []):
            yield from _walk(branch)
        yield from _walk(schema.get("items"))


def _name_models(properties: dict[str, Any], prop: str, names: list[str]) -> None:
    """`properties[prop]`, a model's name, takes one of `names` (or null where it could be left out); without
    names (none served) it stays any string."""
    if prop not in properties or not names:
        return
    nullable = any(b.get("type") == "null" for b in properties[prop].get("anyOf", []))
    named = {"type": "string", "enum": names}
    properties[prop] = {"anyOf": [named, {"type": "null"}]} if nullable else named


def _bound(prop: dict[str, Any] | None, maximum: int) -> None:
    for branch in _branches(prop):
        if branch.get("type") == "integer":
            branch["maximum"] = min(branch.get("maximum", maximum), maximum)


def _branches(prop: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    if prop:
        yield prop
        yield from prop.get("anyOf", [])
