"""llama.cpp's server API (/completion, /props, /tokenize's `content`, /detokenize's `content`, /health's body) on a
tiny random model served in process: the greedy answer /v1/completions gives, streamed as llama-server streams it,
its stop reasons, token probabilities, biases, grammars, and errors."""
from __future__ import annotations

import json

import httpx
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tiny_2k_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512,
                                                speculative_config="off"),
                            LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": engine}))
    yield srv
    srv.stop()
    engine.shutdown()


def complete(server, **body) -> dict:
    r = server.post("/completion", json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(server, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/completion", json={"prompt": PROMPT, "temperature": 0, "stream": True,
                                                                  **body}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    assert "[DONE]" not in text  # llama-server ends with its final event
    return [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n") if block.strip()]


def test_completion_is_the_completions_answer_streamed_or_not(server):
    ref = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    out = complete(server, n_predict=12)
    assert out["content"] == ref.choices[0].text and out["stop"] is True
    assert (out["stop_type"], out["tokens_predicted"]) == ("limit", 12)
    assert out["tokens_evaluated"] == ref.usage.prompt_tokens and out["model"] == "tiny"
    evs = events(server, n_predict=12)
    assert all(e["stop"] is False for e in evs[:-1]) and evs[-1]["stop"] is True and evs[-1]["content"] == ""
    assert "".join(e["content"] for e in evs) == out["content"]
    assert (evs[-1]["stop_type"], evs[-1]["tokens_predicted"]) == ("limit", 12)


def test_stop_reasons_biases_and_probabilities(server):
    text = complete(server, n_predict=12)["content"]
    assert len(text) >= 6
    word = text[3:6]  # a stop string the greedy answer meets
    out = complete(server, n_predict=12, stop=[word])
    assert (out["stop_type"], out["stopping_word"]) == ("word", word) and word not in out["content"]
    eos = httpx.get(f"{server.url}/tokenizer_info").json()["eos_token_ids"][0]
    out = complete(server, n_predict=12, logit_bias=[[eos, 100.0]])  # the end of text first: "eos"
    assert (out["stop_type"], out["content"], out["tokens_predicted"]) == ("eos", "", 1)
    first = server.post("/tokenize", json={"content": text}).json()["tokens"][0]
    piece = server.post("/detokenize", json={"tokens": [first]}).json()["content"]
    for bias in ([[first, False]], {str(first): -100.0}):  # by id, OpenAI's form
        out = complete(server, n_predict=1, logit_bias=bias)
        assert out["content"] != piece, bias
    ids = server.post("/tokenize", json={"content": " hello"}).json()["tokens"]
    pieces = {server.post("/detokenize", json={"tokens": [i]}).json()["content"] for i in ids}
    out = complete(server, n_predict=1, logit_bias=[[" hello", 100.0]])  # by text: each of its tokens
    assert out["content"] in pieces
    out = complete(server, n_predict=5, n_probs=3, seed=-1)
    probs = out["completion_probabilities"]
    assert len(probs) == 5 and "".join(p["token"] for p in probs) == out["content"]
    assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["logprob"] == p["logprob"] for p in probs)
    streamed = [p for e in events(server, n_predict=5, n_probs=3) for p in e.get("completion_probabilities", [])]
    assert [p["token"] for p in streamed] == [p["token"] for p in probs]


def test_grammar_and_json_schema_constrain_the_output(server):
    out = complete(server, n_predict=8, grammar='root ::= "yes" | "no"')
    assert out["content"] in ("yes", "no") and out["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    out = complete(server, n_predict=40, json_schema=schema, temperature=1.0, seed=3)
    assert isinstance(json.loads(out["content"])["a"], int)


def test_props_tokenize_detokenize_health(server):
    props = httpx.get(f"{server.url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 2048 and props["total_slots"] > 0
    assert "<|im_start|>" in props["chat_template"] and "/" not in props["model_path"]
    plain = server.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    special = server.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    vllm = server.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]  # vLLM's default: special
    assert special == vllm and special[len(special) - len(plain):] == plain
    assert server.post("/detokenize", json={"tokens": plain}).json()["content"] == "Hello world"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_errors(server):
    cases = [({"return_tokens": True}, 400, "return_tokens"), ({"n_probs": 21}, 400, "n_probs"),
             ({"grammar": 'root ::= "a"', "json_schema": {}}, 400, "grammar"), ({"model": "nope"}, 404, "nope"),
             ({"prompt": ""}, 400, "empty"), ({"grammar": "root ::= ("}, 400, "grammar"),
             ({"logit_bias": [["x" * 65, 1.0]]}, 400, "logit_bias"),
             ({"logit_bias": [[1, 1.0]] * 1025}, 400, "logit_bias"), ({"repeat_penalty": 0}, 400, "repeat_penalty"),
             ({"json_schema": {"type": "nonsense"}}, 400, "nonsense")]
    for extra, status, word in cases:
        r = server.post("/completion", json={"prompt": PROMPT, "n_predict": 2, **extra})
        assert r.status_code == status and word in r.json()["error"]["message"], (extra, r.text)
        assert r.json()["error"]["param"] in (None, *extra, "grammar or json_schema"), r.text
    r = server.post("/tokenize", json={"content": "a", "prompt": "b"})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = server.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "mirostat": 2, "cache_prompt": True})
    assert r.status_code == 200
    assert set(r.headers["x-pagedlm-unknown-fields"].split(",")) == {"cache_prompt", "mirostat"}
    assert server.wait_idle(30)["pagedlm:kv_blocks_used"] == 0


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    """The request is aborted (not run to its 2,000 tokens) and its blocks freed."""
    aborted = "vllm:request_success_total{finished_reason=abort}"
    before = server.metrics().get(aborted, 0.0)
    with httpx.stream("POST", f"{server.url}/completion", json={"prompt": PROMPT, "n_predict": 2000, "stream": True,
                                                                  "ignore_eos": True}, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: ")
    idle = server.wait_idle(30)
    assert idle["pagedlm:kv_blocks_used"] == 0 and idle["vllm:num_requests_running"] == 0
    assert server.metrics()[aborted] - before == 1
