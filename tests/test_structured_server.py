"""Structured outputs and token controls over HTTP (tiny random model, in-process server): OpenAI's
response_format (with the official client's `chat.completions.parse`), vLLM's structured_outputs and guided_*
fields, logit_bias / allowed_token_ids / bad_words, prompt_logprobs and echo scoring, and unknown request fields
(a warning header, or 400 with --strict-request-fields)."""
from __future__ import annotations

import json
import re
import threading
from typing import Literal

import jsonschema
import pydantic
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.params import MAX_LOGIT_BIAS_ENTRIES
from pagedlm.server import MAX_PROMPT_LOGPROB_ENTRIES
from pagedlm.server.api import UNKNOWN_FIELDS_HEADER, build_app
from pagedlm.server.endpoints import logprobs as logprob_format

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "kind": {"enum": ["cat", "dog"]},
                   "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                   "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
                             "required": ["name"], "additionalProperties": False}},
    "required": ["id", "kind", "flags", "owner"], "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=256),
                         LoopConfig.offline(log_interval=0))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = InProcessServer(build_app({"tiny": engine}))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict(engine):
    srv = InProcessServer(build_app({"tiny": engine}, strict_request_fields=True))
    yield srv
    srv.stop()


def post(server, path: str, body: dict):
    return server.post(path, json={"model": "tiny", **body})


def error(r, status: int = 400) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]["message"]


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)


class Pet(pydantic.BaseModel):
    id: int = pydantic.Field(ge=0, le=999)
    kind: Literal["cat", "dog"]
    vaccinated: bool
    owner: Owner


def test_openai_parse_with_a_pydantic_model(server):
    client = server.client()
    for seed in range(3):
        r = client.chat.completions.parse(model="tiny", messages=MSGS, response_format=Pet, temperature=1.0,
                                          seed=seed, max_tokens=200)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Pet) and msg.parsed.kind in ("cat", "dog")


def test_response_format_json_schema_on_chat_and_completions(server):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    chat = post(server, "/v1/chat/completions", {"messages": MSGS, "response_format": rf, "n": 4, "seed": 1,
                                                 "temperature": 1.0, "max_tokens": 200}).json()
    cmpl = post(server, "/v1/completions", {"prompt": "A pet:", "response_format": rf, "n": 4, "seed": 2,
                                            "temperature": 1.0, "max_tokens": 200}).json()
    texts = [c["message"]["content"] for c in chat["choices"]] + [c["text"] for c in cmpl["choices"]]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    obj = post(server, "/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "json_object"},
                                                "temperature": 0, "max_tokens": 60}).json()["choices"][0]
    assert obj["message"]["content"].startswith("{")
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)


def test_vllm_structured_outputs_and_guided_fields(server):
    def texts(body, n=4):
        r = post(server, "/v1/completions", {"prompt": "Answer:", "n": n, "seed": 3, "temperature": 1.0,
                                             "max_tokens": 200, **body})
        assert r.status_code == 200, r.text
        return [c["text"] for c in r.json()["choices"]]

    assert set(texts({"structured_outputs": {"choice": ["red", "blue"]}}, n=6)) <= {"red", "blue"}
    assert set(texts({"guided_choice": ["up", "down"]}, n=6)) <= {"up", "down"}
    for t in texts({"guided_regex": r"[A-Z][a-z]{2}-\d\d"}) + texts({"structured_outputs": {"regex": r"\d{4}"}}):
        assert re.fullmatch(r"[A-Z][a-z]{2}-\d\d|\d{4}", t), t
    for t in texts({"guided_json": SCHEMA}, n=2) + texts({"structured_outputs": {"json": json.dumps(SCHEMA)}}, n=2):
        jsonschema.validate(json.loads(t), SCHEMA)
    for t in texts({"guided_grammar": 'start: "go " DIR\nDIR: "north" | "south"'}):
        assert t in ("go north", "go south"), t


def test_streamed_constrained_output(server):
    client = server.client()
    chunks = client.chat.completions.create(
        model="tiny", messages=MSGS, stream=True, temperature=1.0, seed=9, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_constraint_errors_are_400(server):
    assert "Invalid json constraint" in error(post(server, "/v1/chat/completions", {
        "messages": MSGS, "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}}))
    assert "Invalid regex constraint" in error(post(server, "/v1/completions", {"prompt": "x", "guided_regex": "(a"}))
    assert "Invalid grammar constraint" in error(post(server, "/v1/completions", {
        "prompt": "x", "structured_outputs": {"grammar": "start: missing"}}))
    assert "one output constraint" in error(post(server, "/v1/completions", {
        "prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}))
    assert "exactly one" in error(post(server, "/v1/completions", {
        "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}))
    assert "beam search" in error(post(server, "/v1/completions", {
        "prompt": "x", "guided_choice": ["a"], "use_beam_search": True, "beam_width": 2}))
    assert "json_schema.schema" in error(post(server, "/v1/chat/completions", {
        "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}))
    assert "structural_tag" in error(post(server, "/v1/completions", {
        "prompt": "x", "structured_outputs": {"structural_tag": "{}"}}))
    assert error(post(server, "/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}))
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200  # still serving


def test_a_constraint_stopped_at_a_grammar_engine_limit_is_400_every_time(server, engine):
    """A constraint that compiles but stops at one of llguidance's limits once it runs (a regex repeated millions of
    times: its lexer; an endless recursion: its parser) is the client's input: 400 constraint_failed, its blocks
    freed, every time. It was a 500, and the compiled constraint it left in the cache then let the same request
    through with only EOS allowed and accepted: an empty 200 that does not match it."""
    for body in ({"structured_outputs": {"regex": "b{4000000}"}}, {"guided_grammar": 'root ::= "a" root'}):
        for _ in range(2):
            r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "constraint_failed"
            assert re.search("lexer error|Too many items", r.json()["error"]["message"])
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
    stats = engine.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_token_controls_over_http(server):
    client = server.client()
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                  logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    tok = server.post("/tokenize", json={"prompt": r.choices[0].text}).json()["tokens"]
    assert tok == [77] * 4 or r.usage.completion_tokens == 4 and set(tok) == {77}
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 1,
                                         "allowed_token_ids": [40, 41], "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200
    ids = server.post("/tokenize", json={"prompt": r.json()["choices"][0]["text"]}).json()["tokens"]
    assert set(ids) <= {40, 41}
    assert "token ids" in error(post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}))
    assert "token ids" in error(post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}))
    assert "vocabulary size" in error(post(server, "/v1/completions", {"prompt": "x",
                                                                        "logit_bias": {"999999": 1}}))
    assert "logit_bias values" in error(post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}))
    many = {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}
    assert "at most" in error(post(server, "/v1/completions", {"prompt": "x", "logit_bias": many}))
    assert "vocabulary size" in error(post(server, "/v1/chat/completions", {"messages": MSGS,
                                                                             "allowed_token_ids": [10**7]}))
    huge = post(server, "/v1/completions", {"prompt": "x", "allowed_token_ids": [40] * 600_000})  # vocabulary 512
    assert "allowed_token_ids holds 600000" in error(huge) and huge.json()["error"]["param"] == "allowed_token_ids"
    assert "bad_words" in error(post(server, "/v1/completions", {"prompt": "x", "bad_words": ["x" * 1000]}))
    ok = post(server, "/v1/completions", {"prompt": "x", "bad_words": ["the", "fox jumps"], "max_tokens": 4})
    assert ok.status_code == 200


def test_echo_scoring_and_prompt_logprobs(server):
    prompt = "The quick brown fox"
    ids = server.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1})
    c = r.json()["choices"][0]
    assert r.status_code == 200 and c["text"] == prompt and c["finish_reason"] == "length"
    lp = c["logprobs"]["token_logprobs"]
    assert len(lp) == len(ids) and lp[0] is None and all(v < 0 for v in lp[1:])
    assert r.json()["usage"]["completion_tokens"] == 0
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:])] == pytest.approx(lp[1:], abs=1e-4)
    assert all(len(e) >= 2 for e in plp[1:])  # the prompt token plus the top 2
    chat = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 5
    assert "streamed" in error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "stream": True,
                                                                "echo": True}))
    assert "needs echo" in error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 0}))


def test_prompt_logprobs_bounded_and_converted_once_off_the_event_loop(server, monkeypatch):
    """n x prompt length x (k + 1) beyond MAX_PROMPT_LOGPROB_ENTRIES is a 400 before any work (prompt_logprobs
    or echo + logprobs: both repeat per choice); below it, the prompt's logprobs are converted once per prompt
    whatever n, on the render stage's threads (not the event loop's; streamed echo too), and every choice carries
    what the conversion made. prompt_logprobs are not streamed (a 400, as in vLLM)."""
    prompt = [40 + i % 300 for i in range(500)]
    assert 100 * 500 * 21 > MAX_PROMPT_LOGPROB_ENTRIES
    for body in ({"prompt_logprobs": 20, "max_tokens": 0}, {"echo": True, "logprobs": 20, "max_tokens": 0},
                 {"echo": True, "logprobs": 20, "max_tokens": 1, "stream": True}):
        r = post(server, "/v1/completions", {"prompt": prompt, "n": 100, **body})
        assert "prompt logprobs" in error(r) and r.json()["error"]["type"] == "invalid_request_error", body
    for path, body in (("/v1/completions", {"prompt": prompt[:5]}), ("/v1/chat/completions", {"messages": MSGS})):
        r = post(server, path, {**body, "prompt_logprobs": 1, "max_tokens": 1, "stream": True})
        assert "not streamed" in error(r) and r.json()["error"]["param"] == "prompt_logprobs"
    chat = post(server, "/v1/chat/completions", {"messages": MSGS, "n": 2, "prompt_logprobs": 20, "max_tokens": 1})
    assert chat.status_code == 200 and len(chat.json()["prompt_logprobs"]) > 5  # one copy per response in chat
    converted, echoed = [], []
    real_convert, real_echo = logprob_format.prompt, logprob_format.add_completion

    def convert(out):
        made = real_convert(out)
        converted.append((threading.current_thread().name, [None if e is None else {t: lp.model_dump()
                                                                                  for t, lp in e.items()}
                                                            for e in made]))
        return made

    def echo(tok, lp, ids, *a):
        if len(ids) == 20:  # the prompt's, not a generated token's
            echoed.append(threading.current_thread().name)
        return real_echo(tok, lp, ids, *a)

    monkeypatch.setattr(logprob_format, "prompt", convert)
    monkeypatch.setattr(logprob_format, "add_completion", echo)
    r = post(server, "/v1/completions", {"prompt": prompt[:20], "n": 4, "prompt_logprobs": 2, "echo": True,
                                         "logprobs": 1, "max_tokens": 0}).json()
    plps = [c["prompt_logprobs"] for c in r["choices"]]
    assert len(plps) == 4 and plps[0][0] is None and len(plps[0]) == 20 and all(p == plps[0] for p in plps)
    assert all(len(c["logprobs"]["tokens"]) == 20 for c in r["choices"])
    assert len(converted) == 1 and len(echoed) == 1 and plps[0] == converted[0][1]
    chat = post(server, "/v1/chat/completions", {"messages": MSGS, "prompt_logprobs": 1, "max_tokens": 1}).json()
    assert len(converted) == 2 and chat["prompt_logprobs"] == converted[1][1]
    sse = post(server, "/v1/completions", {"prompt": prompt[:20], "n": 2, "echo": True, "logprobs": 1, "max_tokens": 2,
                                           "stream": True})
    firsts: dict[int, dict] = {}  # each choice's first chunk: the echo
    for line in sse.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                firsts.setdefault(c["index"], c["logprobs"])
    want = r["choices"][0]["logprobs"]
    assert sorted(firsts) == [0, 1] and all(f["tokens"][:20] == want["tokens"] for f in firsts.values())
    assert all(f["token_logprobs"][:20] == want["token_logprobs"] for f in firsts.values())
    assert len(echoed) == 2
    threads = {name for name, _ in converted} | set(echoed)
    assert all(t.startswith("pagedlm-render") for t in threads), threads

def test_deeply_nested_json_text_is_400(server):
    """JSON given as text inside a request (a schema, an assistant's tool-call arguments) nested past the depth
    the body's own parser allows is a 400 naming the field, not a RecursionError (500); the server goes on."""
    deep, nested = "[" * 10_000, "[" * 200 + "]" * 200  # one past Python's recursion limit, one within it
    for text in (deep, nested):
        for body in ({"structured_outputs": {"json": text}}, {"guided_json": text}):
            r = post(server, "/v1/completions", {"prompt": "x", **body})
            assert "nested more than" in error(r) and r.json()["error"]["param"] == next(iter(body)), body
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}
        msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [call]}]
        r = post(server, "/v1/chat/completions", {"messages": [*msgs, {"role": "user", "content": "ok"}]})
        assert "nested more than" in error(r) and r.json()["error"]["param"] == "messages"
        assert "nested more than" in error(server.post("/tokenize", json={"model": "tiny", "messages": msgs}))
    call["function"]["arguments"] = json.dumps({"a": [[1]]})
    r = post(server, "/v1/chat/completions", {"messages": [*msgs, {"role": "user", "content": "ok"}], "max_tokens": 2})
    assert r.status_code == 200


def test_unknown_fields_header_and_strict_mode(server, strict):
    body = {"prompt": "x", "max_tokens": 1, "frobnicate": 1, "response_format": {"type": "text", "extra_thing": 2}}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200
    assert r.headers[UNKNOWN_FIELDS_HEADER] == "frobnicate,response_format.extra_thing"
    known = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "guided_choice": ["a"],
                                             "prompt_logprobs": 0, "bad_words": ["zz"]})
    assert known.status_code == 200 and UNKNOWN_FIELDS_HEADER not in known.headers
    for path, fields in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                         ("/api/generate", {"prompt": "x", "stream": False, "options": {"num_predict": 1}})):
        r = post(server, path, {**fields, " \u00e9\u00e9 ": 1})  # a header that began with a space: no response
        assert r.status_code == 200 and r.headers[UNKNOWN_FIELDS_HEADER] == "??", (path, r.text)  # (the fuzzer's)
    msg = error(post(strict, "/v1/completions", body))
    assert "frobnicate" in msg and "response_format.extra_thing" in msg
    assert "functions" in error(post(strict, "/v1/chat/completions", {"messages": MSGS, "functions": []}))
    assert post(strict, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
