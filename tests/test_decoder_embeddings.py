"""Embeddings of a generation model (engine/pooling.py): a tiny random LLaMA (fp32) pools its final hidden states
(after the final norm) in the engine, last-token and mean, L2-normalized; the vectors equal HF transformers'
`hidden_states[-1]` pooled and normalized (1e-4), through chunked prefill, batched with generation (whose answers
do not change), after a prefix cache hit and across a preemption by recompute in the middle of a prompt; and
through /v1/embeddings and Ollama's /api/embed on the served generation model."""
from __future__ import annotations

import ollama
import pytest
import torch
from engine_utils import Steps
from server_utils import InProcessServer
from transformers import AutoTokenizer, LlamaForCausalLM

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.errors import ContextLengthError, InvalidRequestError
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.protocol import PoolingParams
from pagedlm.engine.scheduler import SchedulerOutput
from pagedlm.sampling.params import SamplingParams
from pagedlm.server.api import build_app

PROMPTS = [[5, 9, 200], list(range(3, 40)), [(7 * i) % 500 + 3 for i in range(90)], list(range(100, 117))]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny LLaMA with random final-norm (and layer-norm) weights: with ones, the final norm would only scale
    a row, which normalizing hides."""
    path = tmp_path_factory.mktemp("tiny_llama_norms")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.2, 2.0)
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)


def engine(path, **kw) -> LLMEngine:
    return LLMEngine.from_args(str(path), dtype="float32", **{"num_kv_blocks": 64, **kw})


def embed_request(eng: LLMEngine, rid: str, ids: list[int], pooling: str) -> None:
    eng.add_request(eng.input_processor.pooling_request(rid, ids, PoolingParams(pooling)))


def close(vector: list[float] | None, ref: torch.Tensor) -> None:
    assert vector is not None
    v = torch.tensor(vector)
    assert torch.allclose(v, ref, atol=1e-4), (v - ref).abs().max()
    assert abs(float(v.norm()) - 1.0) < 1e-5


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_vectors_equal_hf_and_generation_is_unchanged(model_dir, hf, pooling):
    """Prompts of 3 to 90 tokens in 16-token steps (chunked prefill; a 1-token last chunk), in one batch with two
    greedy generations, whose answers equal those of a run without them."""
    gen = SamplingParams(temperature=0, max_tokens=12)
    alone = engine(model_dir)
    for i, ids in enumerate(PROMPTS[:2]):
        alone.add_request(f"g{i}", ids, gen)
    expected = {rid: o.outputs[0].token_ids for rid, o in Steps(alone).run().items()}
    eng = engine(model_dir, max_num_batched_tokens=16)
    for i, ids in enumerate(PROMPTS):
        embed_request(eng, f"e{i}", ids, pooling)
    for i, ids in enumerate(PROMPTS[:2]):
        eng.add_request(f"g{i}", ids, gen)
    done = Steps(eng).run()
    for i, ids in enumerate(PROMPTS):
        out = done[f"e{i}"]
        close(out.embedding, reference(hf, ids, pooling))
        assert out.finished and [o.token_ids for o in out.outputs] == [[]]
        assert out.outputs[0].finish_reason == "stop"
    assert {rid: done[rid].outputs[0].token_ids for rid in expected} == expected
    assert not eng.has_unfinished_requests() and eng.get_stats().kv_cache_usage == 0


def test_last_pooling_reuses_a_cached_prefix_and_mean_pooling_does_not(model_dir, hf):
    ids = PROMPTS[2]
    eng = engine(model_dir)
    eng.add_request("warm", ids, SamplingParams(temperature=0, max_tokens=1))
    Steps(eng).run()
    embed_request(eng, "last", ids, "last")
    embed_request(eng, "mean", ids, "mean")
    done = Steps(eng).run()
    assert done["last"].num_cached_tokens > 0 and done["mean"].num_cached_tokens == 0
    close(done["last"].embedding, reference(hf, ids, "last"))
    close(done["mean"].embedding, reference(hf, ids, "mean"))


def test_mean_pooling_across_a_preemption_mid_prompt(model_dir, hf):
    """Preempted (recompute) after two of its chunks: the prompt is computed again from the start, the positions
    already summed are not summed twice."""
    ids = PROMPTS[2]
    eng = engine(model_dir, max_num_batched_tokens=16)
    embed_request(eng, "m", ids, "mean")
    steps = Steps(eng)
    steps.step()
    steps.step()
    req = eng.scheduler.running[0]
    assert req.pooler.num_pooled == 32
    eng.scheduler.running.remove(req)
    eng.scheduler._preempt(req, SchedulerOutput())
    done = steps.run()
    assert req.metrics.num_preemptions == 1
    close(done["m"].embedding, reference(hf, ids, "mean"))


def test_inputs_are_checked(model_dir):
    proc = engine(model_dir, max_model_len=64).input_processor
    with pytest.raises(ContextLengthError, match="64 tokens"):
        proc.pooling_request("x", [5] * 65, PoolingParams())
    with pytest.raises(InvalidRequestError, match="integers"):
        proc.pooling_request("x", [5, 10**6], PoolingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        proc.pooling_request("x", [], PoolingParams())
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams("cls")
    assert proc.pooling_request("x", [5] * 64, PoolingParams()).pooling == PoolingParams()  # the whole context


@pytest.fixture(scope="module")
def server(model_dir):
    served = AsyncLLMEngine(engine(model_dir, max_num_batched_tokens=32), LoopConfig.offline(log_interval=0))
    servers = [InProcessServer(build_app({"tiny": served}, embedding_pooling=p, max_prompts_per_request=4))
               for p in ("last", "mean")]
    yield servers
    for s in servers:
        s.stop()
    served.shutdown()


def test_openai_and_ollama_embeddings_of_a_generation_model(server, hf):
    """/v1/embeddings (the `openai` client: float and base64, text and token ids) and Ollama's /api/embed and
    /api/embeddings on the generation model, for each --embedding-pooling; the refusals; nothing left running."""
    tok = AutoTokenizer.from_pretrained(hf.name_or_path)
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3]
    for srv, pooling in zip(server, ("last", "mean")):
        refs = torch.stack([reference(hf, tok.encode(t), pooling) for t in texts])
        client = srv.client()
        r = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
        assert torch.allclose(torch.tensor([d.embedding for d in r.data]), refs, atol=1e-4)
        assert r.model == "tiny" and r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
        packed = client.embeddings.create(model="tiny", input=[tok.encode(t) for t in texts], dimensions=64)
        assert [d.embedding for d in packed.data] == [d.embedding for d in r.data]
        o = ollama.Client(host=srv.url)
        assert torch.allclose(torch.tensor(o.embed(model="tiny:latest", input=texts).embeddings), refs, atol=1e-4)
        assert torch.allclose(torch.tensor(o.embeddings(model="tiny", prompt=texts[0]).embedding), refs[0],
                              atol=1e-4)
    srv = server[0]
    long = list(range(3, 500)) * 5  # 2,485 tokens: past the context (512)
    cases = [({"model": "tiny", "input": [long]}, 400, "512"),
             ({"model": "tiny", "input": "x", "dimensions": 32}, 400, "64"),
             ({"model": "tiny", "input": [[5, 10**6]]}, 400, "Token ids"),
             ({"model": "tiny", "input": ["x"] * 5}, 400, "max_prompts_per_request"),
             ({"model": "tiny", "input": ""}, 400, "empty")]
    for body, status, word in cases:
        r = srv.post("/v1/embeddings", json=body)
        assert r.status_code == status and word in r.json()["error"]["message"], (body, r.text)
    cut = srv.post("/api/embed", json={"model": "tiny", "input": "hello " * 600})  # truncated to the context
    assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 512
    assert srv.post("/api/embed", json={"model": "tiny", "input": "hello " * 600, "truncate": False}).status_code == 400
    assert srv.wait_idle()["vllm:num_requests_running"] == 0
