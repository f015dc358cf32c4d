"""Limits of the second hardening pass, against real servers on 127.0.0.1: open connections and the time a request
may take to arrive."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app
from pagedlm.server.http import uvicorn_config
from pagedlm.server.limits import RequestLimits

READ_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=128,
                                             max_num_seqs=8), LoopConfig.offline(log_interval=0))
    yield eng
    eng.shutdown()


@pytest.fixture
def limited(engine):
    """At most 3 connections; a request must arrive within READ_TIMEOUT."""
    app = build_app({"tiny": engine})
    srv = InProcessServer(app, config=uvicorn_config(app, max_connections=3, request_read_timeout=READ_TIMEOUT,
                                                     access_log=False, shutdown_timeout=0))
    yield srv
    srv.stop()


def _port(srv: InProcessServer) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def _closed_after(sock: socket.socket, limit: float = 5.0) -> tuple[float, bytes]:
    """Seconds until the server closes `sock` (reading everything it sends), and what it sent; fails if it is
    still open after `limit` seconds."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            sock.settimeout(max(0.01, limit - (time.monotonic() - t0)))
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {limit} s (sent {data[:80]!r})")
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, data


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HT",
                                  b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                  b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\": "],
                         ids=["nothing", "partial-request-line", "partial-headers", "partial-body"])
def test_a_request_that_does_not_arrive_in_time_is_closed(limited, sent):
    """uvicorn's keep-alive timer starts only after a response: a socket that stalls before its request is
    complete used to stay open for ever (a few thousand of them exhaust the file descriptors)."""
    with socket.create_connection(("127.0.0.1", _port(limited))) as sock:
        sock.sendall(sent)
        elapsed, data = _closed_after(sock)
    assert READ_TIMEOUT * 0.9 <= elapsed < READ_TIMEOUT + 3, elapsed
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), data
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_slow_but_timely_requests_and_idle_keep_alive_are_not_cut(limited):
    """The deadline runs from a request's first byte: a request sent in pieces within it is answered, and a
    connection idle between requests is kept-alive's business (30 s), not the read timeout's."""
    with socket.create_connection(("127.0.0.1", _port(limited))) as sock:
        sock.settimeout(5)
        for _ in range(2):
            for piece in (b"GET /health HT", b"TP/1.1\r\nHost: 127.0.0.1\r\n", b"\r\n"):
                sock.sendall(piece)
                time.sleep(READ_TIMEOUT / 4)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            time.sleep(READ_TIMEOUT * 1.5)  # idle after a response: still open


def test_connections_beyond_max_connections_get_503_and_open_ones_are_served(limited):
    port = _port(limited)

    def get(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        return r

    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(3)]
    idle = None
    try:
        assert [get(c).status for c in conns] == [200] * 3
        extra = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        extra.request("GET", "/v1/models")
        r = extra.getresponse()
        body = json.loads(r.read())
        assert r.status == 503 and body["error"]["code"] == "too_many_connections", body
        assert r.getheader("connection") == "close" and r.getheader("retry-after")
        extra.close()
        idle = socket.create_connection(("127.0.0.1", port))  # beyond the limit, open, silent
        assert [get(c).status for c in conns] == [200] * 3  # the admitted connections go on being served
        conns.pop().close()
        idle.close()
        deadline = time.monotonic() + 5
        while True:  # the server sees the closes asynchronously
            fresh = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            status = get(fresh).status
            if status == 200 or time.monotonic() > deadline:
                break
            fresh.close()
            time.sleep(0.05)
        conns.append(fresh)
        assert status == 200
    finally:
        for c in conns:
            c.close()
        if idle is not None:
            idle.close()


# --- per-key fairness -------------------------------------------------------------------------------------------
KEYS = ["key-a", "key-b"]


@pytest.fixture
def capped(engine):
    """Two API keys, each with at most 2 requests (prompts) waiting or running."""
    srv = InProcessServer(build_app({"tiny": engine}, api_key=KEYS, max_requests_per_key=2))
    yield srv
    srv.stop()


def _post(srv: InProcessServer, key: str, **body) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, **body})


def test_one_key_is_capped_and_the_others_go_on(capped):
    """A key with 2 prompts streaming gets 429 (OpenAI's rate-limit shape) for a third, while another key is
    served; once its stream ends, the key is served again."""
    body = json.dumps({"model": "tiny", "prompt": ["Once upon a time", "Hello"], "max_tokens": 480, "stream": True,
                       "logprobs": 20, "ignore_eos": True}).encode()
    with socket.socket() as held:  # a client that reads the head of its stream, then nothing: the stream stays open
        held.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        held.connect(("127.0.0.1", _port(capped)))
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEYS[0].encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        assert held.recv(12) == b"HTTP/1.1 200"
        r = _post(capped, KEYS[0])
        err = r.json()["error"]
        assert r.status_code == 429 and err["code"] == "rate_limit_exceeded" and err["type"] == "requests", err
        assert r.headers["retry-after"]
        chat = httpx.post(f"{capped.base_url}/chat/completions", headers={"authorization": f"Bearer {KEYS[0]}"},
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 429
        assert _post(capped, KEYS[1], prompt=["a", "b"]).status_code == 200  # another key: its own cap
    deadline = time.monotonic() + 10
    while (status := _post(capped, KEYS[0]).status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.05)  # the server sees the closed stream asynchronously
    assert status == 200
    r = _post(capped, KEYS[0], prompt=["a", "b", "c"])  # more than the cap at once: never, so not a 429
    assert r.status_code == 400 and "max_requests_per_key" in r.json()["error"]["message"]


def test_client_priority_needs_allow_client_priority(engine):
    srv = InProcessServer(build_app({"tiny": engine}))
    try:
        r = srv.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "priority": -5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        chat = srv.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "priority": 3,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400
        assert srv.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                 "priority": 0}).status_code == 200
    finally:
        srv.stop()
    srv = InProcessServer(build_app({"tiny": engine}, allow_client_priority=True))
    try:
        assert srv.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                 "priority": -5}).status_code == 200
    finally:
        srv.stop()


# --- chat size ----------------------------------------------------------------------------------------------------
def test_chat_messages_and_prompt_characters_are_bounded(engine, monkeypatch):
    """Beyond the message count the template never runs; beyond the character bound (as the template renders the
    chat, overhead included) nothing is tokenized: 400s naming the field."""
    srv = InProcessServer(build_app({"tiny": engine}, limits=RequestLimits(max_chat_messages=4, max_prompt_chars=300)))
    rendered, encoded = [], []
    facade = engine.input_processor
    real_render, real_encode = facade.render_chat, facade.tokenizer.encode
    monkeypatch.setattr(type(facade), "render_chat",
                        lambda self, *a, **kw: rendered.append(1) or real_render(*a, **kw))
    monkeypatch.setattr(facade.tokenizer, "encode", lambda *a, **kw: encoded.append(1) or real_encode(*a, **kw))

    def chat(messages: list[dict], path: str = "/v1/chat/completions") -> httpx.Response:
        return srv.post(path, json={"model": "tiny", "messages": messages, "max_tokens": 2})

    try:
        user = {"role": "user", "content": "hi"}
        assert chat([user] * 4).status_code == 200
        rendered.clear()
        for path in ("/v1/chat/completions", "/tokenize"):
            r = chat([user] * 5, path)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "max_chat_messages" in r.json()["error"]["message"]
        assert not rendered
        encoded.clear()
        near = [{"role": "user", "content": "x" * 290}]  # under the bound, but not once rendered
        for path in ("/v1/chat/completions", "/tokenize"):
            r = chat(near, path)
            assert r.status_code == 400 and "max_prompt_chars" in r.json()["error"]["message"], r.text
        r = srv.post("/v1/completions", json={"model": "tiny", "prompt": ["hi", "y" * 301], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert not encoded
    finally:
        srv.stop()


# --- generated logprobs -------------------------------------------------------------------------------------------
def test_generated_logprobs_are_bounded_per_request(engine):
    """max_tokens (or what the context leaves) x prompts x n x (k + 1) logprob entries kept on the host: beyond
    the bound a 400 before any work; without logprobs there is no such bound."""
    srv = InProcessServer(build_app({"tiny": engine}, limits=RequestLimits(max_logprob_entries=1000)))

    def post(path: str, **body) -> httpx.Response:
        return srv.post(path, json={"model": "tiny", **body})

    try:
        done = dict(max_tokens=50, logprobs=9, n=2)  # 50 x 2 x 10 = 1000
        assert post("/v1/completions", prompt="Hello", **done).status_code == 200
        for body in (dict(done, max_tokens=51), dict(done, prompt=["a", "b"]), dict(done, n=3)):
            r = post("/v1/completions", **{"prompt": "Hello", **body})
            assert r.status_code == 400 and "logprob" in r.json()["error"]["message"], (body, r.text)
        assert post("/v1/completions", prompt="Hello", max_tokens=400, n=4).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4}
        r = post("/v1/chat/completions", **chat)  # no max_tokens: what the context leaves (~500) x 5
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
        assert post("/v1/chat/completions", **chat, max_tokens=200).status_code == 200
    finally:
        srv.stop()


def test_logprobs_kept_share_the_servers_budget_and_are_released_on_disconnect(engine):
    """The logprob entries admitted requests keep (generated: prompts x n x max_tokens x (k + 1); prompt logprobs:
    positions x (k + 1)) share one server-wide budget: beyond what is free a 429 (Retry-After), beyond the whole
    budget a 400; a request holds its share until its response has ended, also when its client goes away
    mid-stream (the share comes back: nothing leaks)."""
    srv = InProcessServer(build_app({"tiny": engine}, logprob_budget=20_000))
    streamed = dict(max_tokens=480, logprobs=20, ignore_eos=True)  # 480 x 21 = 10,080 entries
    held_body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "stream": True, **streamed}).encode()

    def post(path: str, **body) -> httpx.Response:
        return srv.post(path, json={"model": "tiny", **body})

    try:
        with socket.socket() as held:  # reads the head of its stream, then nothing: the stream stays open
            held.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            held.connect(("127.0.0.1", _port(srv)))
            held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(held_body) + held_body)
            assert held.recv(12) == b"HTTP/1.1 200"
            assert srv.metrics()["pagedlm:logprob_entries_held"] == 10_080
            for path, body in (("/v1/completions", dict(prompt="Hello", **streamed)),
                               ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}],
                                                             max_tokens=480, logprobs=True, top_logprobs=20)),
                               ("/v1/completions", dict(prompt=[40] * 480, prompt_logprobs=20, max_tokens=1))):
                r = post(path, **body)
                err = r.json()["error"]
                assert r.status_code == 429 and err["code"] == "rate_limit_exceeded", (body, r.text)
                assert "logprob_budget" in err["message"] and r.headers["retry-after"]
            assert post("/v1/completions", prompt="Hello", max_tokens=20, logprobs=20).status_code == 200  # fits
            r = post("/v1/completions", prompt="Hello", n=2, **streamed)  # 20,160: more than the whole budget
            assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
            assert srv.metrics()["pagedlm:logprob_entries_held"] == 10_080
        deadline = time.monotonic() + 10
        while srv.metrics()["pagedlm:logprob_entries_held"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the server sees the closed stream asynchronously
        assert srv.metrics()["pagedlm:logprob_entries_held"] == 0
        assert post("/v1/completions", prompt="Hello", **streamed).status_code == 200
        assert srv.metrics()["pagedlm:logprob_entries_held"] == 0 and srv.wait_idle()["pagedlm:kv_blocks_used"] == 0
    finally:
        srv.stop()


# --- pre-engine stages ----------------------------------------------------------------------------------------------
FLOOD = 40  # more than the default thread pool's workers (at most 32) that every stage shared before


def test_a_flood_of_slow_constraints_stalls_no_other_stage(engine, monkeypatch):
    """Constraints that take long to compile (held here until released) fill their own stage's 2 threads and 3
    queue places, and the rest of the flood gets 503 server_busy at once; meanwhile other requests are parsed,
    tokenized and served, and /health answers 200 (it runs on no stage)."""
    import pagedlm.engine.input_processor as processor_module

    release, entered = threading.Event(), threading.Semaphore(0)
    real = processor_module.prepare_params

    def slow(params, *args):
        if params.structured_outputs is not None:
            entered.release()
            release.wait(30)
        return real(params, *args)

    monkeypatch.setattr(processor_module, "prepare_params", slow)
    app = build_app({"tiny": engine}, stage_threads=2, stage_queue=3)
    srv, stages = InProcessServer(app), app.state.frontend.stages
    results: list[httpx.Response] = []

    def constrained(i: int) -> None:
        results.append(srv.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                         "structured_outputs": {"regex": f"a{{{i + 1}}}"}}))

    flood = [threading.Thread(target=constrained, args=(i,)) for i in range(FLOOD)]
    try:
        for i, t in enumerate(flood):  # one at a time: each is refused or held before the next is parsed
            t.start()
            deadline = time.monotonic() + 10
            while len(results) + stages.load()["grammar"][0] <= i and time.monotonic() < deadline:
                time.sleep(0.002)
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)  # both threads of the stage are held
        for body in ({"prompt": "Hello there", "max_tokens": 2},
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            r = httpx.post(f"{srv.url}{path}", json={"model": "tiny", **body}, timeout=10)
            assert r.status_code == 200, r.text
        assert httpx.post(f"{srv.url}/tokenize", json={"prompt": "Hello"}, timeout=10).status_code == 200
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        busy = [r for r in results if r.status_code == 503]
        assert len(busy) == FLOOD - 5 and all(r.json()["error"]["code"] == "server_busy" for r in busy)
        assert busy[0].headers["retry-after"]
        m = srv.metrics()
        assert m["pagedlm:stage_jobs{stage=grammar}"] == 5 and m["pagedlm:stage_jobs{stage=parse}"] == 0
        assert m["pagedlm:stage_refused_total{stage=grammar}"] == FLOOD - 5
    finally:
        release.set()
        for t in flood:
            t.join(60)
        srv.stop()
    assert sorted(r.status_code for r in results) == [200] * 5 + [503] * (FLOOD - 5)


def test_a_full_render_stage_ends_a_started_stream_with_an_error_event(engine, monkeypatch):
    """A stream's echo logprobs are made on the render stage; when that stage is full (here: one thread, no queue,
    held by another request's answer) the stream, already started, ends with a server_busy error event and
    [DONE] instead of a dropped connection; the held request is then answered."""
    from pagedlm.server.endpoints import logprobs as logprob_format

    entered, release = threading.Event(), threading.Event()
    real = logprob_format.add_completion

    def held(tok, lp, ids, *a):
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return real(tok, lp, ids, *a)

    monkeypatch.setattr(logprob_format, "add_completion", held)
    srv = InProcessServer(build_app({"tiny": engine}, stage_threads=1, stage_queue=0))
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2, "echo": True, "logprobs": 1}
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(srv.post("/v1/completions", json=body)))
    try:
        first.start()
        assert entered.wait(30)
        r = srv.post("/v1/completions", json={**body, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]", r.text
        assert json.loads(events[-2])["error"]["code"] == "server_busy"
    finally:
        release.set()
        first.join(30)
        srv.stop()
    assert answers[0].status_code == 200 and len(answers[0].json()["choices"][0]["logprobs"]["tokens"]) > 2
