"""Ollama's, Anthropic's and the Responses API's endpoints meet the limits and hostile-client rules of the OpenAI
ones (body size, JSON, key, per-key cap, chat messages, prompt characters, max tokens, stop strings, strict
fields), each error in its own API's shape, and the server keeps serving with every KV block free after."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app
from pagedlm.server.limits import RequestLimits

KEY = "k"
USER = {"role": "user", "content": "Hi"}


def ollama_body(messages, **kw):
    return {"model": "tiny", "messages": messages, "stream": False, "options": {"num_predict": 2, **kw}}


def anthropic_body(messages, **kw):
    return {"model": "tiny", "max_tokens": kw.pop("max_tokens", 2), "messages": messages, **kw}


def responses_body(messages, **kw):
    return {"model": "tiny", "input": messages, "max_output_tokens": kw.pop("max_tokens", 2), **kw}


APIS = {"ollama": ("/api/chat", ollama_body), "anthropic": ("/v1/messages", anthropic_body),
        "responses": ("/v1/responses", responses_body)}


def message_of(api: str, body: dict) -> str:
    """The error message, checking the body is in `api`'s shape."""
    if api == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    if api == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                            LoopConfig.offline(log_interval=0))
    app = build_app({"tiny": engine}, api_key=KEY, max_body_bytes=4000, max_requests_per_key=1,
                    strict_request_fields=True, limits=RequestLimits(max_chat_messages=3, max_prompt_chars=300))
    srv = InProcessServer(app)
    srv.api_key = KEY
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.mark.parametrize("api", APIS)
def test_limits_and_bad_input_in_each_apis_shape(server, api):
    path, body = APIS[api]
    cases = [(body([USER] * 4), 400, "messages"),
             (body([{"role": "user", "content": "x" * 400}]), 400, "characters"),
             (body([{"role": "user", "content": "x" * 5000}]), 413, "exceeds"),
             (body([USER], **({"stop": ["a"] * 100} if api == "ollama" else {"stop_sequences": ["a"] * 100}
                              if api == "anthropic" else {})), 400, "stop"),
             ({**body([USER]), "surprise": 1}, 400, "surprise")]
    if api == "responses":
        cases.pop(3)
    for payload, status, word in cases:
        r = server.post(path, json=payload)
        assert r.status_code == status, (payload, r.text)
        assert word in message_of(api, r.json()), (payload, r.text)
    r = server.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in message_of(api, r.json())
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = server.post(path, content=b"x=1", headers={**form, "Origin": "https://evil.example"})
    assert r.status_code == 415 and message_of(api, r.json())
    r = server.post(path, content=b"x=1", headers=form)  # curl -d, not a browser: read as JSON
    assert r.status_code == 400 and "JSON" in message_of(api, r.json())
    r = httpx.post(f"{server.url}{path}", json=body([USER]))
    assert r.status_code == 401 and "API key" in message_of(api, r.json())
    r = httpx.post(f"{server.url}{path}", json=body([USER]), headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("api", APIS)
def test_per_key_cap_holds_across_apis(server, api):
    """While one request of the key streams (to a client that reads its head, then nothing), another of any API is
    a 429 in its own shape; once it ended (the client closed it), the key may run again, and nothing is left."""
    path, body = APIS[api]
    held_body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "stream": True,
                            "logprobs": 20, "ignore_eos": True}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        held.connect(("127.0.0.1", port))
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(held_body)
                     + held_body)
        assert held.recv(12) == b"HTTP/1.1 200"
        r = server.post(path, json=body([USER]))
        assert r.status_code == 429 and "at most 1" in message_of(api, r.json()) and r.headers["retry-after"]
    deadline = time.monotonic() + 10
    while (r := server.post(path, json=body([USER]))).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)  # the server sees the closed stream asynchronously
    assert r.status_code == 200, r.text
    assert server.wait_idle()["pagedlm:kv_blocks_used"] == 0


def test_routed_model_through_each_api(tiny_model_dir):
    """`model: "auto"` is routed for Ollama's, Anthropic's and the Responses API as for chat completions: the
    answer names the model the router chose."""
    from server_utils import routed_server

    from pagedlm.router import HeuristicPolicy, ModelEntry, Router

    router = Router([ModelEntry("small"), ModelEntry("big", strong=True)], HeuristicPolicy())
    with routed_server(tiny_model_dir, router) as (srv, _, _):
        bodies = {"/api/chat": {**ollama_body([USER]), "model": "auto"},
                  "/v1/messages": {**anthropic_body([USER]), "model": "auto"},
                  "/v1/responses": {**responses_body([USER]), "model": "auto"}}
        for path, body in bodies.items():
            r = srv.post(path, json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedlm-routed-model"] in ("small", "big"), path
