"""--reasoning-parser: a tiny random model forced by a regex constraint to think in `<think>...</think>` gets its
reasoning answered apart (`reasoning_content`, streamed as deltas) on /v1/chat/completions, and in Ollama's
(`thinking`), Anthropic's (thinking blocks) and the Responses API's (reasoning items) shapes; `enable_thinking`
reaches the chat template (chat_template_kwargs, Ollama's `think`)."""
from __future__ import annotations

import anthropic
import ollama
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app
from pagedlm.server.endpoints import ServedModel
from pagedlm.server.protocol import StructuredOutputs
from pagedlm.server.reasoning import ThinkParser

THOUGHT = r"<think>[a-z]{2,12}( [a-z]{2,12}){0,3}</think>\n\n[A-Z][a-z]{2,12}( [a-z]{2,12}){0,3}\."
MSGS = [{"role": "user", "content": "Hello"}]
FORCE = {"structured_outputs": {"regex": THOUGHT}}
# the tiny template, with a thought closed at once when thinking is off (as Qwen3's does)
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
            "{% endif %}")


def test_split():
    r1, qwen = ThinkParser(opened=True), ThinkParser(opened=False)
    assert r1.split("a b</think>\n\nAnswer") == ("a b", "Answer", 0)
    assert r1.split("<think>a b</think>Answer") == ("a b", "Answer", 0)
    assert r1.split("still thinking") == ("still thinking", "", 0)
    assert r1.split("still thinking</thi", final=False) == ("still thinking", "", 5)
    assert qwen.split("plain answer") == ("", "plain answer", 0)
    assert qwen.split("\n<think>x</think>\n\ny") == ("x", "y", 0)
    assert qwen.split("<thi", final=False) == ("", "", 4)
    assert qwen.split("<think>x", final=False) == ("x", "", 0)


@pytest.fixture(scope="module")
def servers(tiny_2k_model_dir):
    eng = LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512)
    eng.tokenizer.hf.chat_template = TEMPLATE
    engine = AsyncLLMEngine(eng, LoopConfig.offline(log_interval=0))
    qwen = InProcessServer(build_app({"tiny": engine}, reasoning_parser="qwen3"))
    r1 = InProcessServer(build_app({"tiny": engine}, reasoning_parser="deepseek_r1"))
    plain = InProcessServer(build_app({"tiny": engine}))
    yield qwen, r1, plain
    for s in (qwen, r1, plain):
        s.stop()
    engine.shutdown()


def test_chat_completions_reasoning_content(servers):
    qwen, r1, plain = servers
    raw = plain.client().chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=80,
                                                 extra_body=FORCE).choices[0].message.content
    thought, answer = raw.removeprefix("<think>").split("</think>\n\n")
    for srv in (qwen, r1):
        client = srv.client()
        m = client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=80,
                                           extra_body=FORCE).choices[0].message
        assert (m.model_extra["reasoning_content"], m.content) == (thought, answer)
        chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=80,
                                                     extra_body=FORCE, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
        assert "".join(d.content or "" for d in deltas) == answer
    free = r1.client().chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=8)
    assert free.choices[0].message.content == "" and free.choices[0].message.model_extra["reasoning_content"]
    free = qwen.client().chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=8)
    assert free.choices[0].message.content and not free.choices[0].message.model_extra.get("reasoning_content")


@pytest.fixture
def forced_thought(monkeypatch):
    """The other APIs have no regex constraint to ask for: every chat request runs with the thought's."""
    run = ServedModel.chat_completions

    async def forced(self, request, req, *args, **kw):
        thought = StructuredOutputs.model_validate(FORCE["structured_outputs"])
        return await run(self, request, req.model_copy(update={"structured_outputs": thought}), *args, **kw)

    monkeypatch.setattr(ServedModel, "chat_completions", forced)


def test_other_apis_show_the_reasoning(servers, forced_thought):
    qwen, _, _ = servers
    m = qwen.client().chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=80).choices[0]
    thought, answer = m.message.model_extra["reasoning_content"], m.message.content
    assert thought and answer
    client = ollama.Client(host=qwen.url)
    r = client.chat(model="tiny", messages=MSGS, options={"temperature": 0, "num_predict": 80})
    assert (r.message.thinking, r.message.content) == (thought, answer)
    parts = list(client.chat(model="tiny", messages=MSGS, options={"temperature": 0, "num_predict": 80}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == thought
    assert "".join(p.message.content for p in parts) == answer
    a = anthropic.Anthropic(base_url=qwen.url, api_key="none", max_retries=0)
    msg = a.messages.create(model="tiny", max_tokens=80, messages=MSGS, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", thought), ("text", answer)]
    with a.messages.stream(model="tiny", max_tokens=80, messages=MSGS, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == thought
    assert final.content[1].text == answer
    o = qwen.client().responses.create(model="tiny", input="Hello", temperature=0, max_output_tokens=80)
    assert [i.type for i in o.output] == ["reasoning", "message"] and o.output[0].content[0].text == thought
    assert o.output_text == answer
    events = list(qwen.client().responses.create(model="tiny", input="Hello", temperature=0, max_output_tokens=80,
                                                 stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    assert events[-1].type == "response.completed"


def test_enable_thinking_reaches_the_template(servers):
    _, _, plain = servers
    client = ollama.Client(host=plain.url)
    on = client.chat(model="tiny", messages=MSGS, think=True, options={"num_predict": 1})
    off = client.chat(model="tiny", messages=MSGS, think=False, options={"num_predict": 1})
    assert off.prompt_eval_count > on.prompt_eval_count  # the closed thought is in the prompt
    r = plain.client().chat.completions.create(model="tiny", messages=MSGS, max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == off.prompt_eval_count
    bad = plain.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS,
                                                   "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
