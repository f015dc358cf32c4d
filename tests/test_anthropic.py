"""Anthropic's Messages API through the official `anthropic` client, on a tiny random model served in process
(with an API key, sent as `x-api-key`): messages.create and messages.stream give the greedy answer
/v1/chat/completions gives, a tool_use round trip, count_tokens, stop sequences, structured output, and errors in
Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app

KEY = "test-key"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the client no longer has sampling arguments of its own
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                  "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server(tiny_2k_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512),
                            LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": engine}, api_key=KEY))
    srv.api_key = KEY
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_create_and_stream_give_the_chat_completions_answer(server, client):
    expected = server.client().chat.completions.create(
        model="tiny", temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, *MSGS]).choices[0].message.content
    r = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=MSGS, **GREEDY)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == expected
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.role == "assistant" and r.id.startswith("msg_")
    with client.messages.stream(model="tiny", max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                                messages=MSGS, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected and final.content[0].text == expected and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == r.usage.input_tokens and final.usage.output_tokens == 12
    events = [e.type for e in client.messages.create(model="tiny", max_tokens=12, messages=MSGS, stream=True,
                                                     **GREEDY)]
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_stop_sequences_and_sampling(server, client):
    full = client.messages.create(model="tiny", max_tokens=12, messages=MSGS, **GREEDY).content[0].text
    stop = full[3:5]
    r = client.messages.create(model="tiny", max_tokens=12, messages=MSGS, stop_sequences=[stop], **GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert "".join(b.text for b in r.content) == full[:full.index(stop)]
    a, b = (client.messages.create(model="tiny", max_tokens=10, messages=MSGS,
                                   extra_body={"temperature": 1.0, "top_p": 0.9, "top_k": 20}) for _ in range(2))
    assert a.usage.output_tokens == 10 and b.usage.output_tokens == 10


def test_tool_use_round_trip(server, client):
    choice = {"type": "tool", "name": "get_weather"}
    r = client.messages.create(model="tiny", max_tokens=120, messages=MSGS, tools=TOOLS, tool_choice=choice,
                               **GREEDY)
    assert r.stop_reason == "tool_use"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model="tiny", max_tokens=120, messages=MSGS, tools=TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY) as stream:
        streamed = stream.get_final_message()
    (s_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and s_use.name == "get_weather"
    jsonschema.validate(s_use.input, WEATHER)
    history = [*MSGS, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees"},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    final = client.messages.create(model="tiny", max_tokens=12, messages=history, tools=TOOLS, **GREEDY)
    expected = server.client().chat.completions.create(model="tiny", temperature=0, max_tokens=12, tools=OPENAI_TOOLS,
                                                       messages=[*MSGS, {"role": "assistant", "content": "",
                                                                         "tool_calls": [{
                                                                             "id": use.id, "type": "function",
                                                                             "function": {
                                                                                 "name": "get_weather",
                                                                                 "arguments": json.dumps(use.input)}}]},
                                                                 {"role": "tool", "tool_call_id": use.id,
                                                                  "content": "18 degrees"},
                                                                 {"role": "user", "content": "And tomorrow?"}])
    assert final.content[0].text == expected.choices[0].message.content


def test_a_final_assistant_message_is_continued(server, client):
    """A prefill: the last message the assistant's text, its turn left open (vLLM's continue_final_message); the
    answer holds what follows it, and count_tokens counts the open turn."""
    prefilled = [*MSGS, {"role": "assistant", "content": "The capital is"}]
    expected = server.client().chat.completions.create(
        model="tiny", temperature=0, max_tokens=8, messages=prefilled,
        extra_body={"continue_final_message": True, "add_generation_prompt": False}).choices[0].message.content
    r = client.messages.create(model="tiny", max_tokens=8, messages=prefilled, **GREEDY)
    assert r.content[0].text == expected
    ids = server.post("/tokenize", json={"model": "tiny", "messages": prefilled, "add_generation_prompt": False,
                                         "continue_final_message": True}).json()
    assert client.messages.count_tokens(model="tiny", messages=prefilled).input_tokens == ids["count"]


def test_count_tokens(client):
    r = client.messages.create(model="tiny", max_tokens=1, system="Be brief.", messages=MSGS, **GREEDY)
    n = client.messages.count_tokens(model="tiny", system="Be brief.", messages=MSGS).input_tokens
    assert n == r.usage.input_tokens
    assert client.messages.count_tokens(model="tiny", messages=MSGS, tools=TOOLS).input_tokens > n + 100


def test_output_config_format(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Rome"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.messages.create(model="tiny", max_tokens=40, messages=MSGS,
                               output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_errors_in_anthropics_shape(server, client):
    cases = [({"model": "tiny", "messages": MSGS}, 400, "invalid_request_error", "max_tokens"),
             ({"model": "nope", "max_tokens": 4, "messages": MSGS}, 404, "not_found_error", "nope"),
             ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]},
              400, "invalid_request_error", "image"),
             ({"model": "tiny", "max_tokens": 4, "messages": MSGS,
               "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
              "Server tools"),
             ({"model": "tiny", "max_tokens": 4, "messages": MSGS, "temperature": 1.5}, 400, "invalid_request_error",
              "temperature"),
             ({"model": "tiny", "max_tokens": 4, "messages": MSGS, "tool_choice": {"type": "tool"}, "tools": TOOLS},
              400, "invalid_request_error", "name")]
    for body, status, kind, word in cases:
        r = server.post("/v1/messages", json=body, headers={"x-api-key": KEY})
        err = r.json()
        assert r.status_code == status and err["type"] == "error" and err["error"]["type"] == kind, (body, r.text)
        assert word in err["error"]["message"], (body, r.text)
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=MSGS)
