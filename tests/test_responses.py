"""OpenAI's Responses API through the `openai` client on a tiny random model served in process (two API keys):
responses.create and responses.stream give the greedy answer /v1/chat/completions gives, a function-call round
trip, a previous_response_id conversation over the per-key store (bounded, expiring), text.format structured
output, and errors in OpenAI's shape."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server import response_store
from pagedlm.server.api import build_app
from pagedlm.server.response_store import ResponseStore, StoredResponse

KEYS = ["key-a", "key-b"]
GREEDY = {"temperature": 0, "max_output_tokens": 12}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server(tiny_2k_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512),
                            LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": engine}, api_key=KEYS))
    srv.api_key = KEYS[0]
    yield srv
    srv.stop()
    engine.shutdown()


def chat(server, messages, **kw) -> str:
    return server.client().chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                                   **kw).choices[0].message.content


def test_create_and_stream_give_the_chat_completions_answer(server):
    client = server.client()
    expected = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Hello", **GREEDY)
    assert r.output_text == expected and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 12
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].status == "incomplete"  # the message max_output_tokens cut, as OpenAI marks it
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]
    stream = client.responses.create(model="tiny", input=items, stream=True, **GREEDY)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output[0].content[0].text == expected
    assert events[-2].item.status == events[-1].response.output[0].status == "incomplete"
    assert r.model == events[0].response.model == events[-1].response.model == "tiny"
    # no model named: the first served model answers, and the response names it
    unnamed = server.post("/v1/responses", json={"instructions": "Be brief.", "input": "Hello", **GREEDY})
    assert unnamed.status_code == 200 and unnamed.json()["model"] == "tiny"
    assert unnamed.json()["output"][0]["content"][0]["text"] == expected


def test_logprobs_are_the_chat_completions_logprobs(server):
    """include ["message.output_text.logprobs"] and top_logprobs: the output text's logprobs in OpenAI's shape, the
    values /v1/chat/completions gives; streamed, each text delta carries its tokens' and the done events all."""
    client = server.client()
    msgs = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=12, logprobs=True,
                                          top_logprobs=2).choices[0]
    expected = chat.logprobs.model_dump()["content"]
    ask = {"include": ["message.output_text.logprobs"], "top_logprobs": 2, **GREEDY}
    r = client.responses.create(model="tiny", input="Hello", **ask)
    assert r.output_text == chat.message.content
    assert [lp.model_dump() for lp in r.output[0].content[0].logprobs] == expected
    events = list(client.responses.create(model="tiny", input="Hello", stream=True, **ask))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.model_dump(exclude_none=True) for e in deltas for lp in e.logprobs] == expected
    assert all("".join(lp.token for lp in e.logprobs) == e.delta for e in deltas), [
        (e.delta, [lp.token for lp in e.logprobs]) for e in deltas]  # each delta carries its tokens' logprobs
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.model_dump(exclude_none=True) for lp in done.logprobs] == expected
    assert [lp.model_dump() for lp in events[-1].response.output[0].content[0].logprobs] == expected
    plain = client.responses.create(model="tiny", input="Hello", top_logprobs=2, **GREEDY)  # include asks for them
    assert plain.output[0].content[0].logprobs == []
    bad = server.post("/v1/responses", json={"model": "tiny", "input": "Hello", "top_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


def test_structured_output_through_text_format(server):
    class Answer(BaseModel):
        city: Literal["Paris", "Rome"]
        unit: Literal["C", "F"]

    schema = {**WEATHER, "title": "Answer"}
    client = server.client()
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    r = client.responses.create(model="tiny", input="Weather?", text=fmt, temperature=1.0, max_output_tokens=60)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    with client.responses.stream(model="tiny", input="Weather?", text=fmt, temperature=0,
                                 max_output_tokens=60) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), schema)
    parsed = client.responses.parse(model="tiny", input="Weather?", text_format=Answer, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Answer) and parsed.output_parsed.city == json.loads(final.output_text)[
        "city"]


def test_function_call_round_trip(server):
    client = server.client()
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, parallel_tool_calls=False,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                max_output_tokens=80)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, stream=True,
                                          tool_choice="required", parallel_tool_calls=False, temperature=0,
                                          max_output_tokens=80))
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and args[0].arguments == call.arguments and events[-1].type == "response.completed"
    follow = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    final = client.responses.create(model="tiny", input=follow, tools=TOOLS, **GREEDY)
    expected = chat(server, [{"role": "user", "content": "Weather in Paris?"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"id": call.call_id, "type": "function",
                                  "function": {"name": "get_weather", "arguments": call.arguments}}]},
                             {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}],
                    tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}])
    assert final.output_text == expected


def test_previous_response_id_conversation(server):
    client = server.client()
    first = client.responses.create(model="tiny", input="Hello", **GREEDY)
    second = client.responses.create(model="tiny", input="Tell me more", previous_response_id=first.id, **GREEDY)
    expected = chat(server, [{"role": "user", "content": "Hello"},
                             {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "Tell me more"}])
    assert second.output_text == expected and second.previous_response_id == first.id
    third = client.responses.create(model="tiny", input="Again", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    other = openai.OpenAI(base_url=server.base_url, api_key=KEYS[1], max_retries=0)
    with pytest.raises(openai.NotFoundError):  # another key's responses are not there
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tiny", input="x", previous_response_id=first.id, **GREEDY)
    unstored = client.responses.create(model="tiny", input="Hello", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id=second.id, **GREEDY)
    assert e.value.body["code"] == "previous_response_not_found"
    assert first.id in e.value.body["message"] and second.id in e.value.body["message"]  # the gone one named


def test_store_is_bounded_per_key_and_expires(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: clock[0])
    store = ResponseStore(size=2, ttl=60)

    def put(key, rid, previous=None):
        store.put(key, rid, StoredResponse({"id": rid}, [{"role": "user", "content": rid}], previous, clock[0]))

    put("a", "r1")
    put("a", "r2", "r1")
    put("b", "r1")
    assert [m["content"] for m in store.conversation("a", "r2")] == ["r1", "r2"]
    put("a", "r3", "r2")  # the oldest of key a goes; key b keeps its own
    assert store.get("a", "r1") is None and store.conversation("a", "r3") == "r1"  # the first one gone
    assert store.get("b", "r1") is not None and store.get("a", "r3") is not None
    clock[0] += 61
    assert store.get("a", "r3") is None and store.get("b", "r1") is None
    with pytest.raises(ValueError):
        ResponseStore(size=-1, ttl=1)


def test_errors_in_openais_shape(server):
    cases = [({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
             ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              400, "input_image"),
             ({"model": "tiny", "input": "x", "previous_response_id": "resp_nope"}, 404, "not found"),
             ({"model": "tiny", "input": "x", "tool_choice": {"type": "mcp"}, "tools": TOOLS}, 400, "tool_choice"),
             ({"model": "tiny", "input": [{"type": "item_reference", "id": "x"}]}, 400, "item_reference"),
             ({"model": "nope", "input": "x"}, 404, "nope"),
             ({"model": "tiny", "input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400,
              "schema")]
    for body, status, word in cases:
        r = server.post("/v1/responses", json=body)
        err = r.json()["error"]
        assert r.status_code == status and word in err["message"] and "type" in err, (body, r.text)
    assert server.post("/v1/responses", json={"input": "x"}, headers={"Authorization": "Bearer bad"}).status_code \
        == 401
