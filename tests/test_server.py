"""The OpenAI-compatible server: real `pagedlm serve` subprocesses driven by the official openai client,
plus in-process checks of AsyncLLMEngine (queue bound, step failures, early close)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import ollama
import openai
import pytest
from server_utils import InProcessServer, ServerProcess

from pagedlm import LLM, SamplingParams
from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine, QueueFullError, RequestFailedError
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app

PROMPTS = ["The quick brown fox", "Once upon a time, there was", "Hello! How are you today?",
           "It was the best of times, it was the worst of times"]
NO_EOS = {"ignore_eos": True}
KEY = "sk-test-key"


# --- servers ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tiny_model_dir):
    """Both tiny-model servers start together (their start-up overlaps); both are always stopped."""
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", "tiny"]
    servers = {}
    try:
        servers["main"] = ServerProcess(*common, "--num-kv-blocks", "512", "--log-interval", "1")
        servers["guarded"] = ServerProcess(*common, "--num-kv-blocks", "64", "--max-num-seqs", "1",
                                           "--max-waiting", "1", "--max-body-bytes", "4096",
                                           env={"PAGEDLM_API_KEY": KEY})
        servers["guarded"].api_key = KEY  # the key comes from the environment, not --api-key
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def server(launched) -> ServerProcess:
    return launched["main"].wait_ready()


@pytest.fixture(scope="module")
def guarded(launched) -> ServerProcess:
    return launched["guarded"].wait_ready()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=512)


def stream_text(chunks, chat: bool = False) -> tuple[str, list]:
    parts, chunks = [], list(chunks)
    for c in chunks:
        for ch in c.choices:
            parts.append((ch.delta.content if chat else ch.text) or "")
    return "".join(parts), chunks


# --- basics ---------------------------------------------------------------------------------------------------------
def test_startup_logs_models_health(server, client, tiny_model_dir):
    log = server.log()
    assert "KV cache memory report" in log and f"at {server.url}" in log
    assert [m.id for m in client.models.list().data] == ["tiny"]
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["root"] == tiny_model_dir.name  # the model's file name, not where it lies on the server
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_usage_and_greedy_parity(client, tiny_llm):
    """A list of prompts over HTTP gives the same greedy text as LLM.generate, choices in prompt order."""
    resp = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, extra_body=NO_EOS)
    ref = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert resp.usage.completion_tokens == 12 * len(PROMPTS)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    ids = tiny_llm.get_tokenizer().encode(PROMPTS[0])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, extra_body=NO_EOS)
    assert by_ids.choices[0].text == ref[0].outputs[0].text


def test_chat_greedy_parity(client, tiny_llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                          extra_body=NO_EOS)
    ref = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 10


def test_continue_final_message(server, client, tiny_llm):
    """vLLM's continue_final_message: the prompt ends with the last message's text (its turn open), as LLM.chat
    renders it; with add_generation_prompt too, a 400."""
    msgs = [{"role": "user", "content": "Say a word."}, {"role": "assistant", "content": "The word is"}]
    resp = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={**NO_EOS, "continue_final_message": True,
                                                      "add_generation_prompt": False})
    ref = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                        add_generation_prompt=False, continue_final_message=True)[0]
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert tiny_llm.get_tokenizer().decode(ref.prompt_token_ids).endswith("assistant\nThe word is")
    tokens = server.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                            "continue_final_message": True}).json()["tokens"]
    assert tokens == ref.prompt_token_ids and resp.usage.prompt_tokens == len(tokens)
    r = server.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "continue_final_message": True})
    assert r.status_code == 400 and "cannot both be true" in r.json()["error"]["message"]


# --- streaming ------------------------------------------------------------------------------------------------------
def test_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", max_tokens=20, temperature=0, extra_body=NO_EOS)
    for prompt in PROMPTS[:2]:
        full = client.completions.create(prompt=prompt, **kw).choices[0].text
        text, chunks = stream_text(client.completions.create(prompt=prompt, stream=True,
                                                             stream_options={"include_usage": True}, **kw))
        assert text == full
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
        assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    msgs = [{"role": "user", "content": "Hello! How are you today?"}]
    full = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    text, chunks = stream_text(client.chat.completions.create(messages=msgs, stream=True, **kw), chat=True)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length" and not chunks[-1].choices[0].delta.content


def test_chat_stream_wire_format(server):
    """Role delta first, content deltas, a finish chunk, a usage chunk with no choices, then [DONE]."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = events[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert all("content" in e["choices"][0]["delta"] for e in events[1:-2])


def test_stop_strings_streamed_text_never_cut(client):
    """Streaming holds back text that may become a stop string; the text streamed equals the final text."""
    kw = dict(model="tiny", max_tokens=40, temperature=0, extra_body=NO_EOS)
    checked = 0
    for prompt in PROMPTS:
        free = client.completions.create(prompt=prompt, **kw).choices[0].text
        for stop in {free[len(free) // 2:len(free) // 2 + 3], free[5:9]}:
            if len(stop) < 2 or stop not in free[1:]:
                continue
            expected = free[:free.index(stop)]
            full = client.completions.create(prompt=prompt, stop=[stop, "\x00never"], **kw).choices[0]
            assert full.text == expected and full.finish_reason == "stop" and full.model_extra["stop_reason"] == stop
            streamed, chunks = stream_text(client.completions.create(prompt=prompt, stop=stop, stream=True, **kw))
            assert streamed == expected and chunks[-1].choices[0].finish_reason == "stop"
            chat_msgs = [{"role": "user", "content": prompt}]
            chat_full = client.chat.completions.create(messages=chat_msgs, **kw).choices[0].message.content
            if len(chat_full) > 6:
                cstop = chat_full[3:6]
                want = chat_full[:chat_full.index(cstop)]
                text, _ = stream_text(client.chat.completions.create(messages=chat_msgs, stop=cstop, stream=True,
                                                                     **kw), chat=True)
                assert text == want
            checked += 1
    assert checked >= 2


def test_n2_index_mapping_and_seed(client):
    """Choice index = prompt_index * n + sample_index; seeded sampling is reproducible across requests."""
    kw = dict(model="tiny", max_tokens=8, temperature=1.0, seed=1234, n=2, extra_body=NO_EOS)
    batch = client.completions.create(prompt=PROMPTS[:2], **kw)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in batch.choices}
    for i, prompt in enumerate(PROMPTS[:2]):
        single = client.completions.create(prompt=prompt, **kw)
        assert {c.index: c.text for c in single.choices} == {0: by_index[2 * i], 1: by_index[2 * i + 1]}
    assert batch.usage.completion_tokens == 4 * 8
    streamed = {}
    for chunk in client.completions.create(prompt=PROMPTS[:2], stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == by_index
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
    assert [c.index for c in chat.choices] == [0, 1]


def test_completion_logprobs_and_echo(server, client):
    prompt = "Once upon a time"
    n_prompt = len(server.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                     echo=True, extra_body=NO_EOS)
    c = resp.choices[0]
    lp = c.logprobs
    assert c.text.startswith(prompt) and len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for chosen, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen)  # greedy: the top token
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=0,
                                      extra_body=NO_EOS).choices[0]
    assert plain.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n_prompt:], abs=1e-4)
    assert c.text == prompt + plain.text
    echo_only = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                          extra_body=NO_EOS).choices[0]
    assert echo_only.text == c.text and echo_only.logprobs is None
    ids = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                    extra_body={**NO_EOS, "return_tokens_as_token_ids": True}).choices[0].logprobs
    assert ids.token_logprobs == lp.token_logprobs and ids.text_offset == lp.text_offset  # vLLM's option: the ids
    tokens = [int(t.removeprefix("token_id:")) for t in ids.tokens]
    assert server.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == c.text
    assert all(len(top) >= len(t) and all(k.startswith("token_id:") for k in top)  # equal texts stay apart
               for top, t in zip(ids.top_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]))


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 and "".join(e.token for e in content) == resp.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert bytes(e.bytes).decode() == e.token
    streamed = [e for ch in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3, stream=True, extra_body=NO_EOS) for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    by_id = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           temperature=0, logprobs=True, top_logprobs=3,
                                           extra_body={**NO_EOS, "return_tokens_as_token_ids": True})
    for e, ref in zip(by_id.choices[0].logprobs.content, content, strict=True):  # vLLM's option: ids, same values
        assert e.token.startswith("token_id:") and e.logprob == ref.logprob and e.bytes == ref.bytes
        assert [t.logprob for t in e.top_logprobs] == [t.logprob for t in ref.top_logprobs]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                       temperature=0, logprobs=True,
                                       extra_body={"structured_outputs": {"regex": "東京"}})
    content = r.choices[0].logprobs.content  # tokens holding part of a character: U+FFFD as text, their own bytes
    assert r.choices[0].message.content == "東京" and any(e.token == "\ufffd" for e in content)
    assert b"".join(bytes(e.bytes) for e in content) == "東京".encode()


def test_lm_eval_loglikelihood_request(server, tiny_llm):
    """What lm-eval's local-completions sends for loglikelihood: token-id prompts, echo, logprobs=1,
    max_tokens=1. The echoed prompt logprobs equal the engine's prompt_logprobs."""
    tok = tiny_llm.get_tokenizer()
    ctx, cont = tok.encode("The capital of France"), tok.encode(" is Paris")
    body = {"model": "tiny", "prompt": [ctx + cont, ctx], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234}
    choices = sorted(server.post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
    lp = choices[0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1
    ref = tiny_llm.generate([ctx + cont], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs
    want = [e[t].logprob for t, e in zip(ctx + cont, ref) if e is not None]
    assert lp["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)
    loglik = sum(lp["token_logprobs"][len(ctx):-1])
    is_greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][len(ctx):-1],
                                                            lp["top_logprobs"][len(ctx):-1]))
    assert loglik < 0 and isinstance(is_greedy, bool)
    assert len(choices[1]["logprobs"]["tokens"]) == len(ctx) + 1


# --- tokenizer endpoints ------------------------------------------------------------------------------------------
def test_tokenize_detokenize_tokenizer_info(server, tiny_llm):
    tok = tiny_llm.get_tokenizer()
    r = server.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert len(r["token_strs"]) == r["count"]
    text = server.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert text == {"prompt": "Hello world", "content": "Hello world"}  # vLLM's field, llama-server's
    msgs = [{"role": "user", "content": "Hi"}]
    r = server.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and "<|im_start|>" in info["chat_template"]
    assert "tokenizer_class" in info
    assert server.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert server.post("/tokenize", json={}).status_code == 400


# A template that writes each message's `name` (the tiny one ignores it) and knows no tool calls.
NAMED_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] }}{% if m.name %}{{ ' ' + m.name }}{% endif %}"
                  "{{ '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NAMED_CHAT = [{"role": "user", "name": "alice", "content": "What is the weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]


@pytest.fixture(scope="module")
def named(tiny_model_dir):
    """An in-process server whose chat template renders `name`."""
    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    engine.tokenizer.hf.chat_template = NAMED_TEMPLATE
    eng = AsyncLLMEngine(engine, LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": eng}))
    yield srv
    srv.stop()
    eng.shutdown()


def test_tokenize_renders_messages_as_chat_does(named):
    """/tokenize of messages is the chat completion's prompt: the `name` and the tool calls are rendered."""
    r = named.post("/tokenize", json={"messages": NAMED_CHAT, "return_token_strs": True}).json()
    chat = named.post("/v1/chat/completions", json={"messages": NAMED_CHAT, "max_tokens": 1}).json()
    assert r["count"] == chat["usage"]["prompt_tokens"]
    text = "".join(r["token_strs"]).replace("\u0120", " ").replace("\u010a", "\n")
    assert "user alice" in text and '"name": "get_weather"' in text
    anon = [{k: v for k, v in m.items() if k != "name"} for m in NAMED_CHAT]
    assert named.post("/tokenize", json={"messages": anon}).json()["count"] < r["count"]


def test_llm_chat_renders_as_the_server(named, tiny_model_dir):
    """LLM.chat renders through the same render_chat: its prompt is the server's, tool calls as Hermes text."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    llm.get_tokenizer().hf.chat_template = NAMED_TEMPLATE
    out = llm.chat(NAMED_CHAT, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == named.post("/tokenize", json={"messages": NAMED_CHAT}).json()["tokens"]
    assert "<tool_call>" in llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)


# --- errors -------------------------------------------------------------------------------------------------------
def test_errors_map_to_client_exceptions(server, client):
    bad = [dict(temperature=-1), dict(top_p=0), dict(n=0), dict(max_tokens=0), dict(logprobs=21),
           dict(extra_body={"top_k": -5}), dict(extra_body={"min_tokens": 50}, max_tokens=10),
           dict(prompt="word " * 600), dict(prompt=[1, 2, 10**6]), dict(prompt=[]), dict(prompt=""),
           dict(extra_body={"max_tokens": "5"}), dict(extra_body={"n": True}), dict(extra_body={"stop": 5}),
           dict(extra_body={"temperature": "hot"}), dict(logit_bias={"1": 500}), dict(suffix="x"),
           dict(extra_body={"max_tokens": 4.5}), dict(extra_body={"n": 2.0, "max_tokens": 0.0})]
    whole = client.completions.create(model="tiny", prompt=[40, 41.0], extra_body={"max_tokens": 3.0, "n": 2.0})
    assert len(whole.choices) == 2 and whole.usage.prompt_tokens == 2  # 3.0 is the integer 3 (JSON Schema's too)
    for kw in bad:
        kw = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **kw}
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(**kw)
        err = ei.value.body
        assert ei.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"], kw
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 600}])
    with pytest.raises(openai.BadRequestError, match=r"do not fit in the KV cache \(512 blocks; one sequence fits"):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=500, n=20)  # 20 x 32 blocks > 512
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError):  # stream errors are answered before the stream starts
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=-1,
                                       stream=True)
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=2)
    assert ei.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    for body in [b"{not json", b"[1, 2]", b"", b'{"prompt": "x", "max_tokens": NaN}']:
        r = server.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, body
    r = httpx.get(f"{server.url}/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{server.base_url}/completions").status_code == 405
    ok = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body={"unknown_field": [1]})
    assert ok.choices[0].text is not None  # unknown fields are let through (named in x-pagedlm-unknown-fields)
    m = server.wait_idle()
    assert m["pagedlm:kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0


# --- disconnects and load -------------------------------------------------------------------------------------------
def test_50_concurrent_streams_with_disconnects_free_all_blocks(server):
    """50 concurrent streams; every third client disconnects after 3 chunks. The rest complete, the
    disconnected ones are aborted, and the KV cache drains to zero."""
    before = server.metrics().get("vllm:request_success_total{finished_reason=abort}", 0.0)

    async def one(ac: openai.AsyncOpenAI, i: int):
        drop = i % 3 == 0
        stream = await ac.completions.create(model="tiny", prompt=PROMPTS[i % 4] + f" {i}", stream=True,
                                             temperature=0.8, seed=i, max_tokens=300 if drop else 24,
                                             extra_body=NO_EOS)
        chunks, finish = 0, None
        async for chunk in stream:
            chunks += 1
            finish = chunk.choices[0].finish_reason or finish
            if drop and chunks == 3:
                await stream.close()
                return "dropped", None
        return "done", finish

    async def main():
        async with server.async_client(timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(50)))

    results = asyncio.run(main())
    assert results.count(("dropped", None)) == 17
    assert results.count(("done", "length")) == 33
    m = server.wait_idle()
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["pagedlm:kv_blocks_used"] == 0
    assert m["pagedlm:kv_blocks_free"] == m["pagedlm:kv_blocks_total"] == 512
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:request_success_total{finished_reason=abort}"] - before == 17
    assert m["vllm:time_to_first_token_seconds_count"] >= 50 and m["vllm:e2e_request_latency_seconds_count"] >= 33
    assert m["vllm:generation_tokens_total"] >= 33 * 24


def test_non_streaming_disconnect_aborts(server):
    before = server.metrics().get("vllm:request_success_total{finished_reason=abort}", 0.0)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True,
            "temperature": 0, "n": 16}  # seconds of work however fast the steps are, so the client gives up first
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    deadline = time.monotonic() + 10
    while server.metrics().get("vllm:request_success_total{finished_reason=abort}", 0.0) - before < 1:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.05)
    assert server.wait_idle()["pagedlm:kv_blocks_used"] == 0


def test_periodic_stats_log_line(server):
    deadline = time.monotonic() + 5
    while "Avg generation throughput" not in server.log():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    line = next(x for x in server.log().splitlines() if "Avg generation throughput" in x)
    assert all(s in line for s in ("Running:", "Waiting:", "KV cache usage:", "Preemptions:"))


# --- auth, body limit, queue bound (a second server) ---------------------------------------------------------------
def test_api_key(guarded):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0).models.list()
    r = httpx.post(f"{guarded.base_url}/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{guarded.url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes and scrapes need no key
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200
    assert guarded.client().completions.create(model="tiny", prompt="Hello", max_tokens=2).choices


def test_body_limit_413(guarded):
    with pytest.raises(openai.APIStatusError) as ei:
        guarded.client().completions.create(model="tiny", prompt="x" * 5000, max_tokens=2)
    assert ei.value.status_code == 413 and ei.value.body["code"] == "request_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'
    r = guarded.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_queue_full_503_with_retry_after(guarded):
    """max_num_seqs=1, max_waiting=1: one request runs, one waits, the next gets 503 + Retry-After."""
    c = guarded.client()
    body = dict(model="tiny", max_tokens=480, temperature=0, stream=True, extra_body=NO_EOS)
    running = c.completions.create(prompt="Once upon a time", **body)
    next(iter(running))
    waiting = c.completions.create(prompt="The quick brown fox", **body)
    deadline = time.monotonic() + 5
    while guarded.metrics()["vllm:num_requests_waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = guarded.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    with pytest.raises(openai.InternalServerError) as ei:
        c.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert ei.value.status_code == 503
    running.close()
    waiting.close()
    m = guarded.wait_idle()
    assert m["pagedlm:kv_blocks_used"] == 0 and m["pagedlm:requests_rejected_total"] >= 2


# --- AsyncLLMEngine in process ----------------------------------------------------------------------------------------
@pytest.fixture()
def async_engine(tiny_model_dir):
    eng = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                         LoopConfig.offline(max_waiting=2, log_interval=0))
    yield eng
    eng.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_async_engine_generate_and_early_close(async_engine, tiny_llm):
    async def main():
        outs = [o async for o in async_engine.generate(PROMPTS[0], GREEDY, "a")]
        lens = [len(o.outputs[0].token_ids) for o in outs]  # outputs not read in time are merged into the newest
        assert lens == sorted(set(lens)) and lens[-1] == 16 and outs[-1].finished
        with pytest.raises(ValueError):
            async for _ in async_engine.generate("word " * 600, GREEDY, "too-long"):
                pass
        gen = async_engine.generate(PROMPTS[1], SamplingParams(max_tokens=400, ignore_eos=True), "b")
        async for o in gen:
            if len(o.outputs[0].token_ids) == 2:
                break
        await gen.aclose()
        return outs[-1]

    last = asyncio.run(main())
    assert last.outputs[0].text == tiny_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    deadline = time.monotonic() + 5
    while async_engine.stats.num_free_blocks != async_engine.stats.num_total_blocks:
        assert time.monotonic() < deadline, "blocks of the closed request were not freed"
        time.sleep(0.01)
    assert async_engine.engine.get_num_unfinished_requests() == 0


def test_async_engine_queue_bound_and_step_failure(async_engine):
    """Requests queued while the engine is busy meet the bound in order; a failing step fails the requests it
    ran with RequestFailedError, and the loop keeps serving."""
    eng = async_engine.engine
    real_step, gate, calls = eng.step, threading.Event(), []

    def step():
        calls.append(1)
        if len(calls) == 1:
            gate.wait(10)
            raise RuntimeError("injected failure")
        return real_step()

    eng.step = step

    async def main():
        first = await async_engine.add_request("z", PROMPTS[0], GREEDY)
        while not calls:
            await asyncio.sleep(0.001)
        process = async_engine.input_processor.process
        streams = [async_engine.submit(process(f"q{i}", PROMPTS[i], GREEDY)) for i in range(3)]
        gate.set()
        verdicts = await asyncio.gather(*(s.accepted() for s in streams), return_exceptions=True)
        with pytest.raises(RequestFailedError):
            async for _ in first:
                pass
        done = []
        for s, v in zip(streams, verdicts):
            if v is None:
                done.append(await s.result())
        return verdicts, done

    verdicts, done = asyncio.run(main())
    assert verdicts[:2] == [None, None] and isinstance(verdicts[2], QueueFullError)
    assert [len(o.outputs[0].token_ids) for o in done] == [16, 16]
    assert async_engine.num_failed == 1 and async_engine.num_rejected == 1 and async_engine.is_running
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


# --- the real model --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_http_matches_llm(smollm2_path):
    """SmolLM2-135M-Instruct: greedy completions and chat over HTTP equal LLM.generate / LLM.chat, and the
    streamed chat text equals the non-streamed one. fp32 pinned: the answer must not depend on the CPU's paths."""
    srv = ServerProcess("--model", str(smollm2_path), "--num-kv-blocks", "128", "--served-model-name", "smollm2",
                        "--dtype", "float32")
    try:
        llm = LLM(str(smollm2_path), num_kv_blocks=128, dtype="float32")
        srv.wait_ready()
        c = srv.client()
        prompts = ["The capital of France is", "def fibonacci(n):"]
        params = SamplingParams(temperature=0, max_tokens=8)
        ref = llm.generate(prompts, params, use_tqdm=False)
        resp = c.completions.create(model="smollm2", prompt=prompts, max_tokens=8, temperature=0)
        assert [ch.text for ch in resp.choices] == [r.outputs[0].text for r in ref]
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        ref_chat = llm.chat(msgs, params, use_tqdm=False)[0].outputs[0].text
        chat = c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == ref_chat and "Paris" in ref_chat
        streamed, _ = stream_text(c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8,
                                                            temperature=0, stream=True), chat=True)
        assert streamed == ref_chat
        assert srv.wait_idle()["pagedlm:kv_blocks_used"] == 0
        show = ollama.Client(host=srv.url).show("smollm2")  # the GGUF's own type and metadata, as Ollama shows them
        assert show.details.quantization_level == "Q4_1" and show.details.format == "gguf"
        assert show.modelinfo["general.file_type"] == 3 and show.modelinfo["tokenizer.ggml.model"] == "gpt2"
        assert show.modelinfo["llama.context_length"] == llm.engine.max_model_len
    finally:
        srv.stop()
