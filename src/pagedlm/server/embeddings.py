"""Embeddings: OpenAI's POST /v1/embeddings and Ollama's /api/embed and /api/embeddings, answered by the embedding
models served with --embedding-model (engine/embedding_engine.py: a BERT encoder, batched) or by a generation
model, whose engine pools its final hidden states (endpoints/embed.py, engine/pooling.py: --embedding-pooling,
L2-normalized). Inputs are checked as prompts are (count, characters, tokens, the key's cap) on the same stage
pools."""
from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Mapping
from typing import Annotated, Literal, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from pagedlm.engine.embedding_engine import EmbeddingEngine
from pagedlm.engine.errors import EngineError
from pagedlm.server import ollama_protocol as O
from pagedlm.server import protocol as P
from pagedlm.server.bridge import Bridge, reply
from pagedlm.server.endpoints import ServedModel
from pagedlm.server.errors import api_error
from pagedlm.server.protocol import APIError
from pagedlm.server.streaming import unless_disconnected


class Embedder(Protocol):
    """What answers a request's inputs: an embedding model (`EmbeddingEngine`) or a generation model's."""

    dim: int
    vocab_size: int
    max_tokens: int  # per input

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def truncate(self, ids: list[int]) -> list[int]: ...

    async def embed(self, ids: list[list[int]]) -> torch.Tensor: ...


class GenerationEmbedder:
    """A served generation model as one request's `Embedder`: its tokenizer, its context as the longest input
    (truncation keeps the first tokens), its engine pooling the hidden states."""

    def __init__(self, model: ServedModel, request: Request) -> None:
        self.model, self.request = model, request
        self.dim, self.vocab_size = model.embedding_dim, model.processor.vocab_size
        self.max_tokens = model.processor.max_model_len

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.model.embedding_ids(texts)

    def truncate(self, ids: list[int]) -> list[int]:
        return ids[:self.max_tokens]

    async def embed(self, ids: list[list[int]]) -> torch.Tensor:
        return await self.model.embed(self.request, ids)


class EmbeddingRequest(P.Request):
    model: str | None = None
    input: str | list[str] | list[P.Int] | list[list[P.Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), P.WHOLE] | None = None
    user: str | None = None


def add_embedding_routes(app: FastAPI, bridge: Bridge, embedders: Mapping[str, EmbeddingEngine]) -> EmbeddingsAPI:
    api = EmbeddingsAPI(bridge, embedders)
    app.post("/v1/embeddings")(api.openai)
    app.post("/api/embed")(api.ollama_embed)
    app.post("/api/embeddings")(api.ollama_embeddings)
    return api


class EmbeddingsAPI:
    def __init__(self, bridge: Bridge, embedders: Mapping[str, EmbeddingEngine]) -> None:
        self.bridge, self.front, self.embedders = bridge, bridge.front, embedders
        self.created = int(time.time())

    def cards(self) -> list[P.ModelCard]:
        return [P.ModelCard(id=name, created=self.created, root=e.path.name, max_model_len=e.max_tokens)
                for name, e in self.embedders.items()]

    def engine(self, model: str | None, request: Request) -> tuple[str, Embedder]:
        """The embedder of `model` (none: the first embedding model, else the first generation model); 404 for a
        name not served, 400 for the auto model (name the model to embed with)."""
        names = (model, model.removesuffix(":latest")) if model else ()
        for name in names:
            if name in self.embedders:
                return name, self.embedders[name]
        for name in names:
            if name in self.front.models:
                return name, GenerationEmbedder(self.front.models[name], request)
        if not model:
            if self.embedders:
                return next(iter(self.embedders.items()))
            return self.front.default.name, GenerationEmbedder(self.front.default, request)
        if self.front.is_auto(model):
            raise APIError(400, f"`{model}` routes generation requests; name the model to embed with.",
                           param="model")
        served = ", ".join([*self.embedders, *self.front.models])
        raise APIError(404, f"The model `{model}` does not exist (embeddings from: {served}).", param="model",
                       code="model_not_found")

    async def openai(self, request: Request) -> Response:
        req, unknown = await self.bridge.parse(request, EmbeddingRequest)
        name, engine = self.engine(req.model, request)
        if req.dimensions is not None and req.dimensions != engine.dim:
            raise APIError(400, f"`{name}` makes {engine.dim}-dimensional embeddings; `dimensions` can only be "
                                f"{engine.dim}.", param="dimensions")
        inputs = req.input if isinstance(req.input, list) and req.input and not isinstance(req.input[0], int) \
            else [req.input]
        vectors, tokens = await self.embed(request, engine, inputs, truncate=False)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(v) if req.encoding_format == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        return reply(JSONResponse({}), {"object": "list", "data": data, "model": name,
                                        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, unknown)

    async def ollama_embed(self, request: Request) -> Response:
        t0 = time.monotonic_ns()
        req, unknown = await self.bridge.parse(request, O.EmbedRequest)
        _, engine = self.engine(req.model, request)
        if req.dimensions is not None and req.dimensions != engine.dim:
            raise APIError(400, f"this model's embeddings have {engine.dim} dimensions", param="dimensions")
        inputs = [req.input] if isinstance(req.input, str) else req.input
        vectors, tokens = await self.embed(request, engine, inputs, truncate=req.truncate)
        return reply(JSONResponse({}), {"model": req.model, "embeddings": vectors.tolist(),
                                        "total_duration": time.monotonic_ns() - t0, "load_duration": 0,
                                        "prompt_eval_count": tokens}, unknown)

    async def ollama_embeddings(self, request: Request) -> Response:
        req, unknown = await self.bridge.parse(request, O.EmbeddingsRequest)
        _, engine = self.engine(req.model, request)
        vectors, _ = await self.embed(request, engine, [req.prompt], truncate=True)
        return reply(JSONResponse({}), {"embedding": vectors[0].tolist()}, unknown)

    async def embed(self, request: Request, engine: Embedder, inputs: list[str | list[int]],
                    truncate: bool) -> tuple[torch.Tensor, int]:
        """The inputs' vectors and token count, after the checks every prompt meets."""
        if self.front.draining:
            raise P.shutting_down()
        srv = self.front.default
        if not inputs or any(not x for x in inputs):
            raise APIError(400, "The input is empty.", param="input")
        if len(inputs) > srv.max_prompts_per_request:
            raise APIError(400, f"The request has {len(inputs)} inputs; at most {srv.max_prompts_per_request} are "
                                "allowed (max_prompts_per_request).", param="input")
        srv.limits.check_text_prompts(inputs)
        lease = getattr(request.state, "key_lease", None)
        if lease is not None:
            lease.take(len(inputs))
        texts = [x for x in inputs if isinstance(x, str)]
        tokenized = iter(await self.front.stages.run("tokenize", engine.tokenize, texts) if texts else [])
        ids = [next(tokenized) if isinstance(x, str) else list(x) for x in inputs]
        for i, row in enumerate(ids):
            if any(not 0 <= t < engine.vocab_size for t in row):
                raise APIError(400, f"Token ids must be in [0, {engine.vocab_size}).", param="input")
            if len(row) > engine.max_tokens:
                if not truncate:
                    raise APIError(400, f"input[{i}] has {len(row)} tokens; this model embeds at most "
                                        f"{engine.max_tokens}.", param="input", code="context_length_exceeded")
                ids[i] = engine.truncate(row)
        job = asyncio.ensure_future(engine.embed(ids))
        try:
            await unless_disconnected(request, job)  # 499 if the client went away: the job is dropped
            vectors = job.result()
        except EngineError as e:  # queue full (503 + Retry-After), or the embedder stopped (503)
            raise api_error(e) from None
        finally:
            job.cancel()
        return vectors, sum(len(r) for r in ids)


def _base64(v: torch.Tensor) -> str:
    return base64.b64encode(v.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()
