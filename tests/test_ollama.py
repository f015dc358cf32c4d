"""Ollama's native API through the official `ollama` Python client, on a tiny random model served in process:
chat and generate (streamed and not) give the greedy answer /v1/chat/completions gives, `format` constrains the
output, tools and tool calls, the model endpoints, and errors in Ollama's shape."""
from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app
from pagedlm.server.endpoints import ServedModel

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 12}
# the client keeps of a tool's parameters only type, properties (type, description, enum), required: no maxLength
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server(tiny_2k_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512),
                            LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": engine}))
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url)


def openai_chat(server, messages, **kw) -> str:
    return server.client().chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                                   **kw).choices[0].message.content


def test_chat_and_generate_give_the_chat_completions_answer(server, client):
    expected = openai_chat(server, MSGS)
    r = client.chat(model="tiny", messages=MSGS, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == expected
    assert r.done and r.done_reason == "length" and r.eval_count == 12 and r.prompt_eval_count > 0
    parts = list(client.chat(model="tiny:latest", messages=MSGS, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == expected
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done and parts[-1].eval_count == 12
    system = [{"role": "system", "content": "Be brief."}]
    g = client.generate(model="tiny", prompt=MSGS[0]["content"], system="Be brief.", options=GREEDY)
    assert g.response == openai_chat(server, [*system, *MSGS]) and g.done
    streamed = "".join(p.response for p in client.generate(model="tiny", prompt=MSGS[0]["content"],
                                                            system="Be brief.", options=GREEDY, stream=True))
    assert streamed == g.response
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, options=GREEDY)
    completion = server.client().completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                                    max_tokens=12)
    assert raw.response == completion.choices[0].text


def _entries(logprobs, with_bytes: bool = False) -> list[tuple]:
    """(token, logprob, [(token, logprob)]) per token, from Ollama's or OpenAI's logprobs (as dicts); `with_bytes`:
    with each one's bytes too (the `ollama` client's types drop them)."""
    return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) + ((t["bytes"],) if with_bytes else ())
                                        for t in e["top_logprobs"]]) + ((e["bytes"],) if with_bytes else ())
            for e in logprobs]


def test_logprobs_are_the_chat_completions_logprobs(server, client):
    """`logprobs` / `top_logprobs` on /api/chat and /api/generate (streamed and not): Ollama's shape, per answer
    object or NDJSON line, with the values /v1/chat/completions (a raw generate: /v1/completions) gives."""
    content = server.client().chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=12,
                                                      logprobs=True, top_logprobs=3).choices[0].logprobs.model_dump()
    expected = _entries(content["content"])
    assert len(expected) == 12 and all(len(e[2]) == 3 for e in expected)
    r = client.chat(model="tiny", messages=MSGS, options=GREEDY, logprobs=True, top_logprobs=3)
    assert _entries(r.model_dump()["logprobs"]) == expected and r.logprobs[0].token == expected[0][0]
    parts = list(client.chat(model="tiny", messages=MSGS, options=GREEDY, logprobs=True, top_logprobs=3,
                             stream=True))
    assert _entries([e for p in parts for e in p.model_dump()["logprobs"] or []]) == expected
    assert all(p.done or "".join(e.token for e in p.logprobs) == p.message.content for p in parts)
    g = server.post("/api/generate", json={"model": "tiny", "prompt": MSGS[0]["content"], "options": GREEDY,
                                           "logprobs": True, "top_logprobs": 3, "stream": False}).json()
    assert _entries(g["logprobs"], with_bytes=True) == _entries(content["content"], with_bytes=True)
    assert "logprobs" not in client.chat(model="tiny", messages=MSGS, options=GREEDY, top_logprobs=3).model_dump(
        exclude_none=True)  # asked for with logprobs: true only, as Ollama
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, options=GREEDY, logprobs=True,
                          top_logprobs=2)
    lp = server.client().completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=12,
                                            logprobs=2).choices[0].logprobs
    assert [e.token for e in raw.logprobs] == lp.tokens and [e.logprob for e in raw.logprobs] == lp.token_logprobs
    assert [[t.token for t in e.top_logprobs] for e in raw.logprobs] == [
        sorted(top, key=lambda t: -top[t])[:2] for top in lp.top_logprobs]
    raw = server.post("/api/generate", json={"model": "tiny", "prompt": "Once upon a time", "raw": True,
                                             "options": GREEDY, "logprobs": True, "stream": False}).json()
    text = b"".join(bytes(e["bytes"]) for e in raw["logprobs"]).decode()  # each token's bytes
    assert text.removesuffix("<|endoftext|>") == raw["response"]  # the end of text has a logprob, not text
    for bad in (21, -1):
        r = server.post("/api/chat", json={"model": "tiny", "messages": MSGS, "logprobs": True, "top_logprobs": bad})
        assert r.status_code == 400 and r.json() == {"error": "top_logprobs must be between 0 and 20"}


def test_a_final_assistant_message_is_continued(server, client):
    prefilled = [*MSGS, {"role": "assistant", "content": "The capital is"}]
    expected = server.client().chat.completions.create(
        model="tiny", temperature=0, max_tokens=12, messages=prefilled,
        extra_body={"continue_final_message": True, "add_generation_prompt": False}).choices[0].message.content
    assert client.chat(model="tiny", messages=prefilled, options=GREEDY).message.content == expected


def test_options_are_mapped(server, client):
    stop = openai_chat(server, MSGS)[2:4]
    r = client.chat(model="tiny", messages=MSGS, options={**GREEDY, "stop": [stop]})
    assert r.message.content == openai_chat(server, MSGS, stop=[stop]) and stop not in r.message.content
    a, b = (client.chat(model="tiny", messages=MSGS, options={"temperature": 1.0, "seed": 7, "top_k": 20,
                                                             "top_p": 0.9, "min_p": 0.01, "repeat_penalty": 1.1,
                                                             "num_predict": 10, "num_thread": 2}, keep_alive="5m")
            for _ in range(2))
    assert a.message.content == b.message.content and a.eval_count == 10  # seeded: the same answer


def test_format_constrains_the_output(server, client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Rome"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    for seed in range(3):
        r = client.chat(model="tiny", messages=MSGS, format=schema,
                        options={"temperature": 1.0, "seed": seed, "num_predict": 60})
        jsonschema.validate(json.loads(r.message.content), schema)
    r = client.generate(model="tiny", prompt="Hi", format="json", options={"temperature": 0, "num_predict": 30})
    expected = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                       temperature=0, max_tokens=30,
                                                       response_format={"type": "json_object"})
    assert r.response.startswith("{") and r.response == expected.choices[0].message.content


@pytest.fixture
def forced_calls(monkeypatch):
    """A random model never picks a tool by itself: every chat request with tools runs as tool_choice "required"
    (the grammar of the calls, on the real engine and parser; Ollama's API has no tool_choice to ask for it), with
    the parameters closed (the client drops additionalProperties, and a random model adds keys for ever)."""
    run = ServedModel.chat_completions

    async def required(self, request, req, *args, **kw):
        if req.tools:
            tools = [t.model_copy(deep=True) for t in req.tools]
            for t in tools:
                t.function.parameters["additionalProperties"] = False
            req = req.model_copy(update={"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
        return await run(self, request, req, *args, **kw)

    monkeypatch.setattr(ServedModel, "chat_completions", required)


def test_tool_calls_and_round_trip(server, client, forced_calls):
    r = client.chat(model="tiny", messages=MSGS, tools=TOOLS, options={"temperature": 0, "num_predict": 120})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER)
    parts = list(client.chat(model="tiny", messages=MSGS, tools=TOOLS, stream=True,
                             options={"temperature": 0, "num_predict": 120}))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather",
                                                                               dict(call.function.arguments))]
    history = [*MSGS, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": dict(call.function.arguments)}}]},
        {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"}]
    final = client.chat(model="tiny", messages=history, options=GREEDY)  # no tools: free text after the result
    expected = server.client().chat.completions.create(model="tiny", temperature=0, max_tokens=12, messages=[
        *MSGS, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(dict(call.function.arguments))}}]},
        {"role": "tool", "content": "18 degrees", "name": "get_weather"}]).choices[0].message.content
    assert final.message.content == expected


def test_model_endpoints(server, client):
    (m,) = client.list().models
    assert m.model == "tiny" and m.size > 0 and m.details.family == "llama" and m.details.format == "safetensors"
    show = client.show("tiny")
    assert show.modelinfo["llama.context_length"] == 2048 and show.modelinfo["general.parameter_count"] > 0
    assert show.details.parameter_size.endswith("K") and show.details.quantization_level == "FLOAT32"
    assert "<|im_start|>" in show.template and "tools" in show.capabilities
    (p,) = client.ps().models
    assert p.model == "tiny" and p.context_length == 2048
    assert httpx.get(f"{server.url}/api/version").json()["version"]
    loaded = client.chat(model="tiny", messages=[])
    assert loaded.done and loaded.done_reason == "load"


def test_what_the_ollama_cli_sends_before_a_chat(server, client):
    """`ollama run` checks the server with HEAD /, and pulls a model /api/show does not know: a served model is
    there (success, streamed or not); any other gets a 404 that says why; managing models is refused (403)."""
    for method in ("HEAD", "GET"):
        r = httpx.request(method, f"{server.url}/")
        assert r.status_code == 200 and (method == "HEAD" or "running" in r.text)
    assert client.pull("tiny:latest").status == "success"
    assert [p.status for p in client.pull("tiny", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert e.value.status_code == 404 and "does not download" in e.value.error and "tiny" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("tiny")
    assert e.value.status_code == 403 and "/api/delete is refused" in e.value.error
    for path in ("/api/copy", "/api/create", "/api/push"):
        r = server.post(path, json={"model": "tiny"})
        assert r.status_code == 403 and set(r.json()) == {"error"}, r.text
    assert client.list().models[0].model == "tiny"


def test_errors_in_ollamas_shape(server, client):
    cases = [("/api/chat", {"model": "nope", "messages": MSGS}, 404, "not found"),
             ("/api/chat", {"model": "tiny", "messages": [{**MSGS[0], "images": ["aGk="]}]}, 400, "images"),
             ("/api/generate", {"model": "tiny", "prompt": "x", "images": ["aGk="]}, 400, "images"),
             ("/api/generate", {"model": "tiny", "prompt": "x", "context": [1, 2]}, 400, "context"),
             ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "fill-in-the-middle"),
             ("/api/generate", {"model": "tiny", "prompt": "x", "template": "{{ .Prompt }}"}, 400, "chat template"),
             ("/api/chat", {"model": "tiny", "messages": MSGS, "options": {"num_ctx": 4096}}, 400, "num_ctx"),
             ("/api/chat", {"model": "tiny", "messages": MSGS, "options": {"temperature": -1}}, 400, "temperature"),
             ("/api/chat", {"model": "tiny", "messages": "hi"}, 400, "messages"),
             ("/api/show", {"model": "nope"}, 404, "not found")]
    for path, body, status, word in cases:
        r = server.post(path, json=body)
        assert r.status_code == status and set(r.json()) == {"error"} and word in r.json()["error"], (body, r.text)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=MSGS)
    assert e.value.status_code == 404
    r = server.post("/api/nothing", json={})
    assert r.status_code == 404 and set(r.json()) == {"error"}


def test_ollama_port_serves_the_same_app(tiny_model_dir):
    """`pagedlm serve --ollama-port` answers every API on a second port too, with the same key, from the same
    engine; the start-up log names it and says how tools are served."""
    import re

    from server_utils import ServerProcess

    srv = ServerProcess("--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", "tiny",
                        "--num-kv-blocks", "64", "--ollama-port", "0", api_key="k").wait_ready()
    try:
        second = re.search(r"Ollama's port: the same API at (http://127\.0\.0\.1:\d+)", srv.log()).group(1)
        assert second != srv.url and "built-in hermes template" in srv.log()
        client = ollama.Client(host=second, headers={"Authorization": "Bearer k"})
        a = client.chat(model="tiny", messages=MSGS, options=GREEDY)
        b = ollama.Client(host=srv.url, headers={"Authorization": "Bearer k"}).chat(model="tiny", messages=MSGS,
                                                                                 options=GREEDY)
        assert a.message.content == b.message.content and a.eval_count == 12
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=second).list()
        assert e.value.status_code == 401 and "API key" in e.value.error
    finally:
        srv.stop()


def test_langchain_chat_ollama(server, client):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    llm = langchain_ollama.ChatOllama(model="tiny", base_url=server.url, temperature=0, num_predict=12)
    answer = llm.invoke(MSGS[0]["content"])
    assert answer.content == client.chat(model="tiny", messages=MSGS, options=GREEDY).message.content
