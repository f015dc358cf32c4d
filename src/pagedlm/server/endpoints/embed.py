"""Embeddings of one served generation model, for /v1/embeddings and Ollama's /api/embed and /api/embeddings
(server/embeddings.py answers them): each input is one pooling request (engine/pooling.py: the prompt's final
hidden states pooled by the engine, `embedding_pooling`, L2-normalized), all submitted or none, checked as prompts
are (the vocabulary, the context, admission), batched by the engine with everything else it runs, and answered
once all finished; the caller's cancellation (a client that went away) aborts them."""
from __future__ import annotations

import asyncio
import time
import uuid

import torch
from fastapi import Request

from pagedlm.engine.errors import EngineError
from pagedlm.engine.protocol import PoolingParams
from pagedlm.server.endpoints.base import EndpointBase, request_ids
from pagedlm.server.errors import api_error
from pagedlm.server.streaming import abort_all


class EmbedEndpoint(EndpointBase):
    embedding_pooling: str = "last"  # PoolingParams.pooling of this model's embeddings (--embedding-pooling)

    @property
    def embedding_dim(self) -> int:
        return self.processor.info.hidden_size

    def embedding_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, as a completion prompt's (with the tokenizer's special tokens)."""
        return [self.tok.encode(t) for t in texts]

    async def embed(self, request: Request, inputs: list[list[int]]) -> torch.Tensor:
        """The inputs' vectors [len(inputs), hidden], float32; 400 for an input outside the vocabulary, longer than
        the context or that could never fit in the KV cache, 503 when the engine's queue is full."""
        arrival, rid = time.monotonic(), f"embd-{uuid.uuid4().hex}"
        pooling, salt = PoolingParams(self.embedding_pooling), self.cache_salt(request, None)
        try:
            requests = [self.processor.pooling_request(i, ids, pooling, arrival, cache_salt=salt)
                        for i, ids in zip(request_ids(rid, len(inputs)), inputs)]
        except EngineError as e:
            raise api_error(e) from None
        streams = await self.submit_requests(requests)
        try:
            outputs = await asyncio.gather(*(s.result() for s in streams))
        except EngineError as e:
            raise api_error(e) from None
        finally:
            abort_all(streams)
        return torch.tensor([o.embedding for o in outputs], dtype=torch.float32)
