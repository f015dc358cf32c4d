"""The soak test: mixed traffic with client disconnects from two API keys against a small KV budget, with the
per-key and connection limits in force, then a forward pass that fails while it prefills a prompt."""
from __future__ import annotations

import asyncio
import random
import socket
import time

import httpx
import pytest
from engine_utils import Steps
from server_utils import InProcessServer

from pagedlm import SamplingParams
from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app
from pagedlm.server.http import uvicorn_config

NO_EOS = {"ignore_eos": True}
KEYS = ["key-heavy", "key-light"]
SOAK_REQUESTS = 320
SOAK_KEY_CAP = 8  # prompts each API key may have waiting or running
SOAK_CONNECTIONS = 24  # the soak's own pool holds 16
FAULT_PROMPT = "Once upon a time, there was a little girl who lived in a village near the forest. Whenever she went " \
               "out, the little girl wore a red riding cloak, so everyone in the village called her Little Red"


@pytest.fixture
def soak(tiny_model_dir):
    """A KV budget small enough to preempt (24 blocks of 16 tokens), behind two API keys, each capped at
    SOAK_KEY_CAP prompts, and SOAK_CONNECTIONS connections."""
    eng = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=24, max_model_len=128,
                                             max_num_seqs=16), LoopConfig(log_interval=0, stream_stall_timeout=10.0))
    app = build_app({"tiny": eng}, api_key=KEYS, max_prompts_per_request=16, max_requests_per_key=SOAK_KEY_CAP)
    srv = InProcessServer(app, config=uvicorn_config(app, max_connections=SOAK_CONNECTIONS, request_read_timeout=10,
                                                     access_log=False, shutdown_timeout=0))
    yield srv, eng
    srv.stop()
    eng.shutdown()


def test_soak_mixed_requests_with_disconnects_limits_and_a_failed_step(soak, monkeypatch):
    """320 mixed requests, 12 at a time: streaming and not, n > 1, beams, stop strings, a shared prefix,
    preemption under a small KV budget, and random client disconnects, from two API keys: a heavy one (9 at a
    time, up to 18 prompts, some cut) past its cap of 8 prompts, and a light one (3 at a time, never cut) within
    it. Midway, a burst of raw connections meets the connection limit. Every request completes (200 and a finished
    answer), was cut by its client, or was refused by a limit in the limit's own shape: 429 only for the heavy
    key, 503 too_many_connections only during the burst. The server stays healthy, every KV block and every
    key's share comes back. Then one forward pass fails: the prompt it was prefilling fails with a 500, and its
    retry finds none of its blocks in the prefix cache (a later run does), with a clean run's greedy answer."""
    srv, eng = soak
    rng = random.Random(0)
    prefix = "It was the best of times, it was the worst of times, "
    outcome = {"completed": 0, "aborted": 0, "rate_limited": 0, "light_rate_limited": 0, "refused": 0}
    burst = {"on": False, "refused": 0, "served": 0}

    def body(i: int) -> tuple[str, dict]:
        kind = i % 6
        b = {"model": "tiny", "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.8]), "seed": i}
        if kind == 5:
            return "/v1/chat/completions", {**b, "messages": [{"role": "user", "content": prefix}],
                                            "stream": rng.random() < 0.5, "n": rng.randint(1, 2)}
        b["prompt"] = prefix + rng.choice(["a", "the", "it was"]) if kind < 3 else rng.choice(
            ["Hello", ["Once upon", "The quick"], "Numbers like 1, 2"])
        if kind == 1:
            b.update(n=rng.randint(2, 4))
        elif kind == 2:
            b.update(use_beam_search=True, beam_width=rng.randint(2, 3), temperature=0)
        elif kind == 3:
            b.update(stop=["the", " of", "x"], **NO_EOS)
        b["stream"] = kind != 2 and rng.random() < 0.5
        return "/v1/completions", b

    async def one(client: httpx.AsyncClient, i: int, gates: dict) -> None:
        path, b = body(i)
        light = i % 4 == 3
        cut = not light and rng.random() < 0.2
        async with gates[light]:
            if i == SOAK_REQUESTS // 3:
                await asyncio.to_thread(connection_burst)
            task = asyncio.ensure_future(request(client, path, b, KEYS[light], light))
            if cut:
                await asyncio.sleep(rng.uniform(0, 0.1))
                task.cancel()
            try:
                outcome[await task] += 1
            except asyncio.CancelledError:
                outcome["aborted"] += 1

    def refused(r: httpx.Response, light: bool) -> str | None:
        code = r.json()["error"]["code"] if r.headers.get("content-type") == "application/json" else None
        if r.status_code == 429 and code == "rate_limit_exceeded":
            return "light_rate_limited" if light else "rate_limited"
        if r.status_code == 503 and code == "too_many_connections" and burst["on"]:
            return "refused"
        return None

    async def request(client: httpx.AsyncClient, path: str, b: dict, key: str, light: bool) -> str:
        headers = {"authorization": f"Bearer {key}"}
        if not b["stream"]:
            r = await client.post(path, json=b, headers=headers)
            if r.status_code != 200:
                assert refused(r, light), r.text
                return refused(r, light)
            assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"])
            return "completed"
        async with client.stream("POST", path, json=b, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                assert refused(r, light), r.text
                return refused(r, light)
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
        return "completed"

    def response(sock: socket.socket) -> bytes:
        sock.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length")))
        while len(rest) < length:
            rest += sock.recv(65536)
        return data + rest

    def connection_burst() -> None:
        """More raw connections than the server takes, each asking /health once: those beyond get 503."""
        burst["on"] = True
        socks = [socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))) for _ in range(30)]
        try:
            for sock in socks:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            for sock in socks:
                head = response(sock)
                if head.startswith(b"HTTP/1.1 503") and b"too_many_connections" in head:
                    burst["refused"] += 1
                else:
                    assert head.startswith(b"HTTP/1.1 200"), head[:200]
                    burst["served"] += 1
        finally:
            for sock in socks:
                sock.close()
            time.sleep(0.2)  # the server sees the closes asynchronously
            burst["on"] = False

    async def main() -> None:
        gates = {False: asyncio.Semaphore(9), True: asyncio.Semaphore(3)}
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=limits) as client:
            await asyncio.gather(*(one(client, i, gates) for i in range(SOAK_REQUESTS)))

    asyncio.run(main())
    assert sum(outcome.values()) == SOAK_REQUESTS and outcome["aborted"] > 10, outcome
    assert outcome["rate_limited"] > 0 and outcome["light_rate_limited"] == 0, outcome
    assert burst["refused"] > 0 and burst["served"] > 0, burst
    assert httpx.get(f"{srv.url}/health").status_code == 200
    m = srv.wait_idle(30)
    assert m["pagedlm:kv_blocks_used"] == 0 and m["vllm:num_preemptions_total"] > 0
    assert m["pagedlm:requests_failed_total"] == 0 and eng.engine.get_num_unfinished_requests() == 0
    for key in KEYS:  # every share came back: each key can hold its whole cap again
        r = srv.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                     json={"model": "tiny", "prompt": ["Hello"] * SOAK_KEY_CAP, "max_tokens": 1})
        assert r.status_code == 200, r.text

    # --- one forward pass fails while it prefills a prompt ---
    real, armed = eng.engine.runner.execute, [True]

    def failing(chunks, logits_index):
        if armed[0] and any(len(c.token_ids) > 2 * 16 for c in chunks):
            armed[0] = False
            raise RuntimeError("injected fault")
        return real(chunks, logits_index)

    def ask() -> tuple[httpx.Response, float]:
        hits = srv.metrics()["vllm:prefix_cache_hits_total"]
        r = srv.post("/v1/completions", headers={"authorization": f"Bearer {KEYS[0]}"},
                     json={"model": "tiny", "prompt": FAULT_PROMPT, "max_tokens": 8, "temperature": 0, **NO_EOS})
        return r, srv.metrics()["vllm:prefix_cache_hits_total"] - hits

    monkeypatch.setattr(eng.engine.runner, "execute", failing)
    failed, _ = ask()
    assert failed.status_code == 500 and "RuntimeError" in failed.json()["error"]["message"], failed.text
    assert not armed[0]
    retry, retry_hits = ask()
    again, again_hits = ask()
    assert retry.status_code == 200 and retry_hits == 0  # nothing of the failed prefill was served from the cache
    assert again_hits >= 2 * 16  # the retry's own blocks were cached: the check above could have seen hits
    clean = LLMEngine.from_args(str(eng.engine.config.model), dtype="float32", num_kv_blocks=24, max_model_len=128,
                                enable_prefix_caching=False)
    clean.add_request("clean", FAULT_PROMPT, SamplingParams(max_tokens=8, temperature=0, **NO_EOS))
    want = Steps(clean).run()["clean"].outputs[0].text
    assert retry.json()["choices"][0]["text"] == again.json()["choices"][0]["text"] == want
    assert srv.wait_idle(30)["pagedlm:kv_blocks_used"] == 0
