"""A thinking-token budget (sampling/thinking.py): after N reasoning tokens `</think>` is forced and the answer goes
on; on /v1/chat/completions (`thinking_token_budget`, or the server's default), and Anthropic's `budget_tokens`. A
tiny random model (fp32, greedy) thinks from the start of its output under the deepseek_r1 parser's rule."""
from __future__ import annotations

import anthropic
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.thinking import ReasoningTags, forced_token
from pagedlm.server.api import build_app

MSGS = [{"role": "user", "content": "Hello"}]
N = 5
R1, QWEN = ReasoningTags(opened=True), ReasoningTags(opened=False)


def test_forced_token():
    start, end = [1, 2], [7, 8, 9]
    assert forced_token(3, R1, start, end, [4, 5]) is None  # under budget
    assert forced_token(3, R1, start, end, [4, 5, 6]) == 7
    assert forced_token(3, R1, start, end, [4, 5, 6, 7]) == 8  # the tag goes on
    assert forced_token(3, R1, start, end, [4, 5, 6, 7, 8]) == 9
    assert forced_token(3, R1, start, end, [4, 5, 6, 7, 8, 9]) is None  # closed: the answer is free
    assert forced_token(3, R1, start, end, [4, 7, 8, 9, 5, 6, 5]) is None  # closed by the model
    assert forced_token(3, R1, start, end, [4, 5, 7]) == 8  # a tag the model began at the budget is finished
    assert forced_token(3, R1, start, end, [1, 2, 4, 5]) is None  # a leading <think> is not reasoning
    assert forced_token(3, R1, start, end, [1, 2, 4, 5, 6]) == 7
    assert forced_token(0, R1, start, end, []) == 7
    assert forced_token(3, QWEN, start, end, [4, 5, 6, 4]) is None  # qwen3: no <think>, no thought
    assert forced_token(3, QWEN, start, end, [1, 2, 4, 5, 6]) == 7


@pytest.fixture(scope="module")
def servers(tiny_2k_model_dir):
    eng = LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512)
    engine = AsyncLLMEngine(eng, LoopConfig.offline(log_interval=0))
    r1 = InProcessServer(build_app({"tiny": engine}, reasoning_parser="deepseek_r1"))
    default = InProcessServer(build_app({"tiny": engine}, reasoning_parser="deepseek_r1", thinking_token_budget=N))
    plain = InProcessServer(build_app({"tiny": engine}))
    qwen = InProcessServer(build_app({"tiny": engine}, reasoning_parser="qwen3"))
    yield r1, default, plain, qwen
    for s in (r1, default, plain, qwen):
        s.stop()
    engine.shutdown()


def _chat(srv, **kw):
    return srv.client().chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=40, **kw)


def test_budget_forces_the_end_of_thinking(servers):
    r1, default, _, _ = servers
    free = _chat(r1).choices[0].message
    assert free.content == "" and free.model_extra["reasoning_content"]  # unchanged without a budget: all thought
    r = _chat(r1, logprobs=True, extra_body={"thinking_token_budget": N}).choices[0]
    tokens = [t.token for t in r.logprobs.content]
    reasoning, content = r.message.model_extra["reasoning_content"], r.message.content
    assert reasoning == "".join(tokens[:N]) and free.model_extra["reasoning_content"].startswith(reasoning)
    assert "".join(tokens[N:]).startswith("</think>") and content
    assert "".join(tokens[N:]).removeprefix("</think>").lstrip("\n") == content  # the answer goes on after it
    chunks = list(r1.client().chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=40,
                                                      stream=True, extra_body={"thinking_token_budget": N}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    m = _chat(default).choices[0].message  # the server's default budget
    assert (m.model_extra["reasoning_content"], m.content) == (reasoning, content)
    zero = _chat(r1, extra_body={"thinking_token_budget": 0}).choices[0].message
    assert not zero.model_extra.get("reasoning_content") and zero.content
    a = anthropic.Anthropic(base_url=r1.url, api_key="none", max_retries=0)
    msg = a.messages.create(model="tiny", max_tokens=40, messages=MSGS, extra_body={"temperature": 0},
                            thinking={"type": "enabled", "budget_tokens": N})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", reasoning), ("text", content)]


def test_bad_budgets_are_400(servers):
    r1, _, plain, _ = servers
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 4}
    for srv, extra in ((r1, {"thinking_token_budget": -1}), (r1, {"thinking_token_budget": "many"}),
                       (plain, {"thinking_token_budget": 4}),
                       (r1, {"thinking_token_budget": 4, "use_beam_search": True, "n": 2})):
        bad = srv.post("/v1/chat/completions", json={**body, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget", bad.text
    for budget in (0, "many"):
        bad = r1.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": MSGS,
                                            "thinking": {"type": "enabled", "budget_tokens": budget}})
        assert bad.status_code == 400 and bad.json()["type"] == "error", bad.text
        assert bad.json()["error"]["type"] == "invalid_request_error"
    ok = plain.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": MSGS,
                                          "thinking": {"type": "enabled", "budget_tokens": 4}})
    assert ok.status_code == 200  # without a reasoning parser Anthropic's budget is ignored, as before
    with pytest.raises(ValueError, match="reasoning parser"):
        build_app({"tiny": None}, thinking_token_budget=4)


def test_qwen3_thinks_only_after_its_own_think_and_a_grammar_wins(servers):
    """qwen3's rule: the thought opens with the output's `<think>` (here a regex makes the model write one); the
    forced tag goes through the grammar, which allows it."""
    qwen = servers[3]
    thought = {"structured_outputs": {"regex": r"<think>[a-z ]{1,80}</think>\n\n[A-Z][a-z]{2,12}\."}}
    r = _chat(qwen, logprobs=True, extra_body={**thought, "thinking_token_budget": 3}).choices[0]
    tokens = [t.token for t in r.logprobs.content]
    k = next(i for i in range(len(tokens)) if "".join(tokens[:i]) == "<think>")
    assert "".join(tokens[k + 3:]).startswith("</think>")
    assert r.message.model_extra["reasoning_content"] == "".join(tokens[k:k + 3]) and r.message.content
    free = _chat(qwen, extra_body={"thinking_token_budget": 3}).choices[0].message  # no <think>: no thought
    assert free.content == _chat(qwen).choices[0].message.content and not free.model_extra.get("reasoning_content")
