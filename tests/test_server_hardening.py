"""Hardening of the HTTP server: bad requests get 4xx and hurt nobody else, browsers are kept out, limits hold,
a stalled reader costs O(1), SIGTERM drains; plus a Hypothesis fuzz of every endpoint (the soak test is in
test_server_soak.py)."""
from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import InProcessServer, ServerProcess

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app

NO_EOS = {"ignore_eos": True}
KEYS = ["key-one", "key-two"]


def make_engine(path, stall_timeout: float = 0.0, **kw) -> AsyncLLMEngine:
    args = {**dict(dtype="float32", num_kv_blocks=256, max_num_seqs=16), **kw}
    return AsyncLLMEngine(LLMEngine.from_args(str(path), **args),
                          LoopConfig(log_interval=0, stream_stall_timeout=stall_timeout))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, stall_timeout=0.5)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    """Bound to 127.0.0.1 as `pagedlm serve` is by default: Host check on, one CORS origin allowed."""
    srv = InProcessServer(build_app({"tiny": engine}, max_prompts_per_request=64, allowed_hosts=[],
                                    allowed_origins=["https://good.example"]))
    slow_network(srv)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(engine):
    """Two API keys, prefix cache salted per key."""
    srv = InProcessServer(build_app({"tiny": engine}, api_key=KEYS, prefix_cache_per_key=True))
    yield srv
    srv.stop()


def slow_network(srv: InProcessServer) -> None:
    """Small kernel send buffers for the connections it accepts: on loopback, autotuning would otherwise buffer
    megabytes for a client that does not read, as a long network path would not."""
    srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)


def completion(srv, **body) -> httpx.Response:
    return srv.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, **body})


# --- one request cannot hurt another ----------------------------------------------------------------------------
def test_poison_parameters_are_400_and_the_batch_goes_on(server):
    """The parameters that failed a whole batch (or produced NaN) are refused; a greedy request beside them
    finishes with the text it has alone."""
    alone = completion(server, temperature=0, max_tokens=16, **NO_EOS).json()["choices"][0]["text"]
    poison = [dict(use_beam_search=True, beam_width=2, length_penalty=1e300),
              dict(use_beam_search=True, beam_width=2, length_penalty=-1e5), dict(temperature=1e300),
              dict(repetition_penalty=1e-300), dict(seed=2**63), dict(top_k=-7)]
    with httpx.Client(timeout=60) as c:
        for kw in poison:
            r = c.post(f"{server.base_url}/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, **kw})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (kw, r.text)
    tiny_top_p = completion(server, temperature=1.0, top_p=1e-300, max_tokens=16, **NO_EOS)
    assert tiny_top_p.status_code == 200 and tiny_top_p.json()["choices"][0]["text"] == alone  # argmax, no NaN


def test_fan_out_and_stop_limits_are_400(server):
    many = completion(server, prompt=["a"] * 512, n=128, max_tokens=1)
    assert many.status_code == 400 and "max_prompts_per_request" in many.json()["error"]["message"]
    assert completion(server, prompt=["a"] * 9, n=8, max_tokens=1).status_code == 400  # 64 is the bound
    assert completion(server, prompt=["a"] * 8, n=8, max_tokens=1).status_code == 200
    assert completion(server, stop=[f"s{i}" for i in range(50_000)]).status_code == 400
    assert completion(server, stop=["x" * 300]).status_code == 400
    assert completion(server, logprobs=21).status_code == 400
    assert completion(server, logprobs=20).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_engine_failure_message_names_class_and_request(server, engine, monkeypatch):
    """Clients get the failure class and request id; the exception's text stays in the log."""
    real = engine.engine.runner.execute

    def execute(*a, **kw):
        monkeypatch.setattr(engine.engine.runner, "execute", real)
        raise RuntimeError("internal detail <object at 0xdeadbeef>")

    monkeypatch.setattr(engine.engine.runner, "execute", execute)
    r = completion(server, temperature=0)
    msg = r.json()["error"]["message"]
    assert r.status_code == 500 and "RuntimeError" in msg and "cmpl-" in msg and "0xdeadbeef" not in msg
    assert completion(server, temperature=0).status_code == 200


# --- browsers, hosts, keys --------------------------------------------------------------------------------------
def test_browsers_must_send_json_bodies(server):
    """A web page's "simple" POST (any Content-Type but JSON) is a 415; curl and the SDKs, which send no Origin or
    Sec-Fetch-Site, have their bodies read as JSON whatever they say (Ollama's own docs use `curl -d '{...}'`)."""
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2})
    pages = ({"origin": "https://evil.example"}, {"origin": "null"}, {"sec-fetch-site": "cross-site"},
             {"origin": "https://good.example", "sec-fetch-site": "same-site"})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"content-type": ctype} if ctype else {}
        for page in pages:
            r = httpx.post(f"{server.base_url}/completions", content=body.encode(), headers={**headers, **page})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (ctype, page)
        r = httpx.post(f"{server.base_url}/completions", content=body.encode(), headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, (ctype, r.text)
        r = httpx.post(f"{server.base_url}/completions", content=b"x=1", headers=headers)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], (ctype, r.text)
    for page in ({}, *pages):
        ok = httpx.post(f"{server.base_url}/completions", content=body.encode(),
                        headers={"content-type": "Application/JSON; charset=utf-8", **page})
        assert ok.status_code == 200, page


def test_host_header_checked_on_loopback(server):
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", ""):
        r = httpx.get(f"{server.url}/v1/models", headers={"host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.2", f"[::1]:{port}"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host}).status_code == 200, host


def test_cors_only_for_allowed_origins(server, keyed):
    pre = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    good = httpx.options(f"{server.base_url}/completions", headers={"origin": "https://good.example", **pre})
    assert good.status_code == 200 and good.headers["access-control-allow-origin"] == "https://good.example"
    evil = httpx.options(f"{server.base_url}/completions", headers={"origin": "https://evil.example", **pre})
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    r = httpx.get(f"{keyed.url}/health", headers={"origin": "https://good.example"})  # default: no CORS at all
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_bearer_any_case_several_keys_and_prefix_cache_per_key(keyed):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several full blocks

    def post(auth: str, **kw) -> httpx.Response:
        return httpx.post(f"{keyed.base_url}/completions", headers={"authorization": auth}, timeout=30,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **kw})

    def hits() -> float:
        return keyed.metrics()["vllm:prefix_cache_hits_total"]

    assert post("Bearer wrong").status_code == 401 and post(KEYS[0]).status_code == 401
    assert post(f"bearer {KEYS[0]}").status_code == 200
    h = hits()
    assert post(f"BEARER {KEYS[0]}").status_code == 200 and hits() > h  # same key: cached prefix
    h = hits()
    assert post(f"Bearer {KEYS[1]}").status_code == 200 and hits() == h  # another key: nothing shared
    assert post(f"Bearer {KEYS[1]}", cache_salt="s1").status_code == 200 and hits() == h  # another salt
    assert post(f"Bearer {KEYS[1]}", cache_salt="s1").status_code == 200 and hits() > h


def test_chat_message_without_content_is_400(server):
    for msgs in ([{"role": "user"}], [{"role": "user", "content": None}],
                 [{"role": "system", "content": "x"}, {"role": "user"}]):
        r = server.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", msgs
        assert server.post("/tokenize", json={"messages": msgs}).status_code == 400


def test_draining_server_refuses_new_work(server):
    front = server.server.config.app.state.frontend if hasattr(server.server.config.app, "state") else None
    front = front or server.server.config.loaded_app.app.state.frontend
    front.begin_shutdown()
    try:
        r = completion(server)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{server.url}/health").status_code == 503
    finally:
        front.draining = False
    assert completion(server).status_code == 200


# --- a client that stops reading --------------------------------------------------------------------------------
def open_stalled_stream(url: str, body: dict) -> socket.socket:
    """POST a streaming request on a raw socket with a tiny receive buffer, and never read the answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


STALL_BODY = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "n": 4, "logprobs": 20,
              "temperature": 1.0, "seed": 0, **NO_EOS}


def test_stalled_stream_is_aborted_and_its_blocks_freed(server, engine):
    before = server.metrics().get("pagedlm:requests_stalled_total", 0.0)
    sock = open_stalled_stream(server.url, {**STALL_BODY, "n": 8})  # ~2 s of generation, stall timeout 0.5 s
    try:
        deadline = time.monotonic() + 30
        while server.metrics().get("pagedlm:requests_stalled_total", 0.0) <= before:
            assert time.monotonic() < deadline, "the stalled stream was not aborted"
            time.sleep(0.1)
        assert server.wait_idle()["pagedlm:kv_blocks_used"] == 0
        sock.settimeout(10)
        while sock.recv(65536):  # the server closed the connection: what it sent drains, then EOF
            pass
    finally:
        sock.close()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


STALLED_RSS_BOUND = 20 * 2**20


def test_stalled_readers_hold_server_memory(tiny_model_dir):
    """8 streams (n=4, 480 tokens) whose clients never read, no stall timeout: generation runs to the end while
    each stream holds only its newest output, so the serving process grows by less than 20 MiB (one queued
    cumulative output per step, as before: O(n T^2) per stream, about 50 MiB here)."""
    eng = make_engine(tiny_model_dir, num_kv_blocks=1024, max_num_seqs=64)
    srv = InProcessServer(build_app({"tiny": eng}))
    slow_network(srv)
    socks = []
    try:
        socks.append(open_stalled_stream(srv.url, {**STALL_BODY, "max_tokens": 64}))  # warm up
        srv.wait_idle(60)
        start = rss_bytes()
        socks += [open_stalled_stream(srv.url, {**STALL_BODY, "seed": i, "logprobs": None}) for i in range(8)]
        time.sleep(0.5)
        m = srv.wait_idle(120)  # generation ends though nobody reads
        assert m["pagedlm:kv_blocks_used"] == 0 and m["vllm:generation_tokens_total"] >= 8 * 4 * 480
        grown = rss_bytes() - start
        assert grown < STALLED_RSS_BOUND, f"RSS grew by {grown / 2**20:.0f} MiB"
    finally:
        for s in socks:
            s.close()
        srv.stop()
        eng.shutdown()


@pytest.fixture(scope="module")
def process(tiny_model_dir):
    srv = ServerProcess("--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", "tiny",
                        "--num-kv-blocks", "1024", "--shutdown-timeout", "1", "--log-interval", "0")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_sigterm_ends_open_streams_with_an_error_and_done(process):
    """SIGTERM with --shutdown-timeout 1: a stream that cannot finish in time (16 x 480 tokens with top-20
    logprobs, several seconds) gets an error event and [DONE]; the process exits."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "stream": True,
            "n": 16, "logprobs": 20, **NO_EOS}
    lines = []
    with httpx.stream("POST", f"{process.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        lines.append(next(it))
        process.proc.send_signal(signal.SIGTERM)
        lines += [line for line in it if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]
    assert process.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert "Ending the 1 requests still open after 1 s" in process.log()


# --- soak and fuzz ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_kv(tiny_model_dir):
    """A KV budget small enough to preempt: 24 blocks of 16 tokens."""
    eng = make_engine(tiny_model_dir, stall_timeout=10.0, num_kv_blocks=24, max_model_len=128)
    srv = InProcessServer(build_app({"tiny": eng}, max_prompts_per_request=16))
    yield srv, eng
    srv.stop()
    eng.shutdown()


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
          "logprobs", "top_logprobs", "echo", "stream", "stream_options", "use_beam_search", "beam_width",
          "length_penalty", "early_stopping", "repetition_penalty", "presence_penalty", "stop_token_ids",
          "min_tokens", "cache_salt", "tokens", "priority", "logit_bias", "response_format", "structured_outputs",
          "guided_json", "guided_regex", "guided_choice", "allowed_token_ids", "bad_words", "prompt_logprobs", "tools",
          "tool_choice"]
VALUE = {
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-3, 600), max_size=6),
                        st.lists(st.text(max_size=6), max_size=3)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"])},
                                               optional={"content": st.none() | st.text(max_size=10)}), max_size=3),
    "max_tokens": st.integers(-2, 40) | JSON, "n": st.integers(-1, 6) | JSON, "stream": st.booleans(),
    "model": st.sampled_from(["tiny", "nope", ""]) | JSON, "use_beam_search": st.booleans(),
}
BODY = st.dictionaries(st.sampled_from(FIELDS), st.nothing(), max_size=0).flatmap(
    lambda _: st.fixed_dictionaries({}, optional={f: VALUE.get(f, JSON) for f in FIELDS}))
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(ENDPOINTS), body=BODY | JSON)
def test_fuzz_endpoints_answer_2xx_or_4xx(small_kv, path, body):
    srv, _ = small_kv
    if isinstance(body, dict) and "max_tokens" not in body:
        body["max_tokens"] = 8
    r = httpx.post(f"{srv.url}{path}", content=json.dumps(body, allow_nan=True).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    assert httpx.get(f"{srv.url}/health").status_code == 200
