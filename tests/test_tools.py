"""Tool calling: the Hermes parser, the built-in tool-aware template, and (tiny random model, in-process server)
tool_choice "required" / named enforced by the constrained decoder, streamed and not, and a call -> tool result ->
answer round trip with the history rendered."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app
from pagedlm.server.tools import HERMES_CHAT_TEMPLATE, HermesToolParser, _call

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_hermes_parser():
    p = HermesToolParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in calls}) == 2
    assert p.parse("no calls here") == ("no calls here", [])
    content, calls = p.parse("<tool_call>not json</tool_call>")
    assert calls == [] and content == "<tool_call>not json</tool_call>"
    _, calls = p.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}')  # cut off by max_tokens: still parsed
    assert calls[0].name == "f"


_OLD_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)  # quadratic on blanks (issue 31)


def old_parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The parser as it was, on the old regex (the reference for identical results)."""
    calls, kept, pos = [], [], 0
    for m in _OLD_BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append((call.name, call.arguments))
    kept.append(text[pos:])
    return "".join(kept).strip() or None, calls


CALL = '{"name": "f", "arguments": {"a": 1}}'
TOOL_TEXTS = [f"<tool_call>{CALL}</tool_call>", f"Sure.\n<tool_call>\n {CALL} \n</tool_call>\nDone.",
              f"<tool_call>{CALL}", f"<tool_call>\n{CALL}\n\n", f"a<tool_call>{CALL}</tool_call>b<tool_call>{CALL}",
              f"<tool_call>bad</tool_call><tool_call>{CALL}</tool_call>", "<tool_call></tool_call>", "<tool_call>",
              f"<tool_call><tool_call>{CALL}</tool_call>", f"x <tool_call>{CALL}</tool_call></tool_call> y",
              f"<tool_call>\u2028{CALL}\u3000</tool_call>", "plain text", "", "   ",
              '<tool_call>{"name": "g", "parameters": {"b": [1, 2]}}</tool_call>\n',
              f"<tool_call>{CALL}</tool_call>\n<tool_call> {CALL}\n</tool_call>"]


def test_hermes_parser_is_linear_and_unchanged():
    """The block scan gives the old regex's results, and model output of blanks inside a block (a client can
    force it with a constraint; the old regex retried the trailing blanks at every position) costs linear time."""
    p = HermesToolParser()
    for text in TOOL_TEXTS:
        content, calls = p.parse(text)
        assert (content, [(c.name, c.arguments) for c in calls]) == old_parse(text), repr(text)
    blanks = " " * 50_000
    for text in (f"<tool_call>x{blanks}y", f"<tool_call>{{{blanks}}}</tool_call>", "<tool_call>" + "\n" * 50_000 + "z",
                 f"<tool_call>{CALL}{blanks}x" * 2):
        t0 = time.perf_counter()
        p.parse(text)
        assert time.perf_counter() - t0 < 1.0


def test_deep_tool_call_output_is_content_and_oversized_call_grammar_is_400(tiny_model_dir):
    """Model output of a `<tool_call>` with JSON nested past Python's recursion limit is content, not a call (nor a
    RecursionError); tools whose required-call grammar is over the grammar limit are a 400 (the tiny template,
    marked as knowing tools so that the built-in one is not used, does not render them: the prompt stays short), and
    the server goes on."""
    from conftest import TINY_CHAT_TEMPLATE

    deep = "<tool_call>" + "[" * 10_000
    assert HermesToolParser().parse(deep) == (deep, [])
    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    eng.tokenizer.hf.chat_template = TINY_CHAT_TEMPLATE + "{# tools are not rendered #}"
    engine = AsyncLLMEngine(eng, LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": engine}, tool_call_parser="hermes"))
    try:
        big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                                for i in range(1000)}}
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            r = srv.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "tool_choice": choice,
                                                       "tools": [{"type": "function", "function": {
                                                           "name": "f", "parameters": big}}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
            assert "longer than" in r.json()["error"]["message"]
        ok = srv.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        srv.stop()
        engine.shutdown()


@pytest.mark.slow
def test_builtin_template_matches_smollm2_without_tools(smollm2_path):
    from pagedlm.hub.tokenizer import load_tokenizer

    hf = load_tokenizer(smollm2_path).hf
    for msgs in (MSGS, [{"role": "system", "content": "Be brief."}, *MSGS,
                        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]):
        assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=HERMES_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory):
    """The tiny random LLaMA with a 2048-token context (the tool instructions alone take ~750 tiny tokens)."""
    import torch
    from conftest import build_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama_2k")
    tok = build_tiny_tokenizer()
    tok.model_max_length = 2048
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def servers(long_tiny_dir):
    eng = LLMEngine.from_args(str(long_tiny_dir), dtype="float32", num_kv_blocks=1024)
    eng.tokenizer.hf.chat_template = HERMES_CHAT_TEMPLATE
    engine = AsyncLLMEngine(eng, LoopConfig.offline(log_interval=0))
    tools = InProcessServer(build_app({"tiny": engine}, tool_call_parser="hermes"))
    plain = InProcessServer(build_app({"tiny": engine}))
    forced = InProcessServer(build_app({"tiny": engine}, tool_call_parser="hermes", auto_tool_choice=False))
    yield tools, plain, forced
    for srv in (tools, plain, forced):
        srv.stop()
    engine.shutdown()


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_named_and_required_tool_choice_are_enforced(servers):
    client = servers[0].client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=named,
                                           temperature=1.0, seed=seed, max_tokens=120)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_weather"})
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", n=4,
                                       temperature=1.0, seed=5, max_tokens=400)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert sum(c.finish_reason == "tool_calls" for c in r.choices) >= 2


def test_streamed_tool_calls(servers):
    client = servers[0].client()
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0, seed=2, max_tokens=120, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_time" and calls[0].index == 0
    assert TIME["properties"]["zone"]["enum"].count(json.loads(calls[0].function.arguments)["zone"]) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_streamed_content_is_the_whole_answers_around_the_calls(finish):
    """Streamed, an answer's content is the whole answer's: text before, between and after its calls, and a block
    that is no call (cut short by max_tokens, or not JSON) as text, each piece once. The text after the first call
    was dropped; only the calls came."""
    from types import SimpleNamespace

    from pagedlm.engine.protocol import CompletionDelta
    from pagedlm.server.endpoints.chat import ChatEndpoint
    from pagedlm.server.streaming import ChoiceState

    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    text = f"Sure. {call} then <tool_call>not json</tool_call> and {call}\n<tool_call>\n{{\"name\": \"get_wea"
    parser = HermesToolParser()
    endpoint, st, sent = SimpleNamespace(tool_parser=parser), ChoiceState(), []
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = CompletionDelta(0, text=piece, finish_reason=finish if last else None)
        sent += ChatEndpoint._tool_chunks(endpoint, st, delta, lambda index, delta, **kw: (delta, kw))
    content = "".join(d.content or "" for d, _ in sent)
    streamed_calls = [(tc.function.name, tc.function.arguments) for d, _ in sent for tc in d.tool_calls or []]
    want_content, want_calls = parser.parse(text)
    assert content.strip() == want_content and "not json" in content and '"get_wea' in content
    assert streamed_calls == [(c.name, c.arguments) for c in want_calls] and len(want_calls) == 2
    assert sent[-1][1]["finish_reason"] == ("tool_calls" if finish == "stop" else "length")


def test_round_trip_renders_the_history(servers):
    client = servers[0].client()
    first = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*MSGS, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.content
    srv = servers[0].server.config.app.state.frontend.models["tiny"]
    from pagedlm.server import protocol as P

    msgs = [P.ChatMessage.model_validate(m) for m in history]
    prompt = srv.tok.decode(srv.chat_prompt(msgs, True, TOOLS), skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the tools, in the system turn
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(json.loads(call.function.arguments))}}}' \
        in prompt
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    from conftest import TINY_CHAT_TEMPLATE  # a template that knows no tools: the calls become Hermes text

    hermes, srv.tok.hf.chat_template = srv.tok.hf.chat_template, TINY_CHAT_TEMPLATE
    try:
        plain = srv.tok.decode(srv.chat_prompt(msgs, True), skip_special_tokens=False)
    finally:
        srv.tok.hf.chat_template = hermes
    assert '<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": ' in plain
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in plain


def test_tool_request_errors(servers):
    tools, plain, _ = servers
    body = {"model": "tiny", "messages": MSGS, "tools": TOOLS}
    r = plain.post("/v1/chat/completions", json={**body, "max_tokens": 120, "tool_choice": "required"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"], r.text  # no flag needed
    assert plain.post("/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2}).status_code == 200
    bad = [{"tool_choice": {"type": "function", "function": {"name": "nope"}}},
           {"tool_choice": "required", "response_format": {"type": "json_object"}},
           {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
           {"tools": None, "tool_choice": "required"}]
    for extra in bad:
        r = tools.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400, (extra, r.text)
    r = plain.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        *MSGS, {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]})
    assert r.status_code == 200  # a history with calls, on a server without a tool parser


def test_without_auto_tool_choice_only_forced_calls_are_served(servers):
    """--no-enable-auto-tool-choice (vLLM without --enable-auto-tool-choice): tools the model may choose to call
    are a 400 naming tool_choice; forced calls and tool_choice "none" are served."""
    forced = servers[2]
    body = {"model": "tiny", "messages": MSGS, "tools": TOOLS, "max_tokens": 120}
    for extra in ({}, {"tool_choice": "auto"}):
        r = forced.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "--no-enable-auto-tool-choice" in r.json()["error"]["message"]
    r = forced.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"], r.text
    assert forced.post("/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2}).status_code == 200
    assert servers[0].post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200  # the default


def test_tool_support_follows_the_template():
    from conftest import TINY_CHAT_TEMPLATE

    from pagedlm.server.tools import tool_support

    own = tool_support(HERMES_CHAT_TEMPLATE)
    assert own.template is None and isinstance(own.parser, HermesToolParser)  # it writes <tool_call>: hermes
    for template in (TINY_CHAT_TEMPLATE, None):
        plain = tool_support(template)
        assert plain.template == HERMES_CHAT_TEMPLATE and "knows no tools" in plain.summary
    assert tool_support("{{ tools }} [TOOL_CALLS]", "hermes").template is None  # a flag wins over the guess


def test_tools_work_without_flags_on_a_template_without_tools(tiny_2k_model_dir):
    """No --tool-call-parser, no --chat-template, a model whose template knows no tools: required and named
    tool_choice are enforced, a request with tools is rendered with the built-in template (the tools in the system
    turn), one without with the model's own."""
    from conftest import TINY_CHAT_TEMPLATE

    from pagedlm.server import protocol as P

    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512),
                            LoopConfig.offline(log_interval=0))
    server = InProcessServer(build_app({"tiny": engine}))
    try:
        srv = server.server.config.app.state.frontend.models["tiny"]
        assert srv.tok.hf.chat_template == TINY_CHAT_TEMPLATE
        msgs = [P.ChatMessage.model_validate(m) for m in MSGS]
        with_tools = srv.tok.decode(srv.chat_prompt(msgs, True, TOOLS), skip_special_tokens=False)
        assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools
        assert srv.tok.decode(srv.chat_prompt(msgs, True), skip_special_tokens=False) == \
            srv.tok.hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
        client = server.client()
        for choice, names in (("required", set(SCHEMAS)), ({"type": "function", "function": {"name": "get_time"}},
                                                          {"get_time"})):
            r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                               temperature=0, max_tokens=120, parallel_tool_calls=False)
            assert r.choices[0].finish_reason == "tool_calls"
            check_calls(r.choices[0].message.tool_calls, names)
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=4)
        assert r.choices[0].finish_reason == "length"  # auto: answered (the random model writes no call)
    finally:
        server.stop()
        engine.shutdown()
