"""A thinking-token budget (sampling/thinking.py): after N reasoning tokens `</think>` is forced and the answer goes
on; on /v1/chat/completions (`thinking_token_budget`, or the server's default), and Anthropic's `budget_tokens`. A
tiny random model (fp32, greedy) thinks from the start of its output under the deepseek_r1 parser's rule. The
engine's incremental scan forces exactly what a search of the whole output does (drafts, forks and preemption
included) and examines a bounded number of tokens per step, however long the output."""
from __future__ import annotations

import random

import anthropic
import pytest
from engine_utils import Steps
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.thinking import ReasoningTags, ThinkingScan, forced_token
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


def _params(budget: int, tags: ReasoningTags, start: list[int], end: list[int]) -> SamplingParams:
    p = SamplingParams(thinking_token_budget=budget, reasoning_tags=tags)
    p._thinking_start_ids, p._thinking_end_ids = start, end
    return p


@pytest.mark.parametrize("end", [[7, 8, 9], [7, 7, 8]])
def test_the_scan_forces_what_a_whole_search_forces(end):
    """Random outputs over the tags' tokens: at every step, and for every draft continuation, the scan over the
    kept tokens gives the token a search of the whole output gives; a fork's copy goes on alone."""
    rng, start = random.Random(0), [1, 2]
    for trial in range(300):
        tags, budget = rng.choice([R1, QWEN]), rng.randrange(6)
        params = _params(budget, tags, start, end)
        out, scan, forks = [], ThinkingScan(), []
        for _ in range(40):
            expected = forced_token(budget, tags, start, end, out)
            assert forced_token(budget, tags, start, end, out, scan) == expected, (trial, out)
            draft = [rng.choice([1, 2, 4, 7, 8, 9]) for _ in range(rng.randrange(4))]
            for j in range(1, len(draft) + 1):
                assert forced_token(budget, tags, start, end, out + draft[:j], scan) == \
                    forced_token(budget, tags, start, end, out + draft[:j]), (trial, out, draft[:j])
            out.append(expected if expected is not None else rng.choice([1, 2, 4, 7, 8, 9]))
            scan.advance(params, out)
            if rng.random() < 0.05:
                forks.append((list(out), scan.copy()))
        for fork_out, fork_scan in forks:
            for _ in range(10):
                expected = forced_token(budget, tags, start, end, fork_out)
                assert forced_token(budget, tags, start, end, fork_out, fork_scan) == expected
                fork_out.append(expected if expected is not None else rng.choice([4, 7, 8]))
                fork_scan.advance(params, fork_out)


@pytest.mark.parametrize("budget", [500, 2000])
def test_the_scan_examines_a_bounded_number_of_tokens_per_step(budget):
    """A thought that runs to its budget, then an answer as long again: each step (the forced-token check and
    the scan's advance) examines the new token and the end tag's length before it, twice at most, whatever the
    output's length (a search of the whole output examines up to `budget` tokens per step)."""
    start, end = [1, 2], [7, 8, 9]
    params, scan, out, per_step = _params(budget, R1, start, end), ThinkingScan(), [], []
    for _ in range(2 * budget):
        before = scan.examined
        forced = forced_token(budget, R1, start, end, out, scan)
        out.append(forced if forced is not None else 4)
        scan.advance(params, out)
        per_step.append(scan.examined - before)
    assert out[budget:budget + 3] == end and scan.done
    assert max(per_step) <= 2 * len(end)


def test_the_engine_forces_the_end_through_forks_and_preemption(tiny_2k_model_dir):
    """Sampled answers (n = 2: the second sample forks the first's scan) in a KV cache too small for all of them at
    once (preemption by recompute): every position where a search of the whole output forces a token holds it."""
    engine = LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=12, block_size=8,
                                 enable_prefix_caching=False)
    budget = 6
    for i in range(4):
        params = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=24, thinking_token_budget=budget,
                                reasoning_tags=R1)
        engine.add_request(f"r{i}", f"Hello {i}, how are you?", params)
    done = Steps(engine).run()
    assert engine.scheduler.num_preemptions > 0
    start = engine.tokenizer.encode("<think>", add_special_tokens=False)
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    forced = 0
    for out in done.values():
        for sample in out.outputs:
            ids = sample.token_ids
            for k in range(len(ids)):
                token = forced_token(budget, R1, start, end, ids[:k])
                if token is not None:
                    assert ids[k] == token, (out.request_id, sample.index, k, ids)
                    forced += 1
    assert forced >= len(end)


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
