"""The engine loop as the server sees it: a request submitted while the loop dies is answered, and /health tells
a step that stopped progressing from a live loop."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from server_utils import InProcessServer

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.params import SamplingParams
from pagedlm.server.api import build_app


def make_engine(path) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine.from_args(str(path), dtype="float32", num_kv_blocks=64),
                          LoopConfig.offline(log_interval=0))


def test_submit_racing_the_loop_s_death_is_answered(tiny_model_dir):
    """`submit` found the loop alive, and the loop ended (and answered everything queued) before the request
    reached its queue: the request still gets EngineDeadError instead of waiting forever."""
    engine = make_engine(tiny_model_dir)
    real = engine._submit

    def loop_dies_first(cmd):
        engine.shutdown(timeout=1.0)  # the loop ends now (or, with the race closed, once this request is queued)
        real(cmd)

    engine._submit = loop_dies_first

    async def go():
        stream = engine.submit(engine.input_processor.process("late", [40, 41, 42], SamplingParams(max_tokens=2)))
        await asyncio.wait_for(stream.accepted(), timeout=10)

    with pytest.raises(EngineDeadError):
        asyncio.run(go())
    engine._thread.join(10)
    assert not engine._thread.is_alive() and not engine.is_running


def test_health_reports_a_step_that_stopped_progressing(tiny_model_dir):
    """/health is 503 while one step has run past the bound with requests waiting for the loop, 200 for a long
    step nobody waits behind, and 200 again once the step ends."""
    engine = make_engine(tiny_model_dir)
    runner = engine.engine.runner
    real, started, release = runner.execute, threading.Event(), threading.Event()

    def stuck(chunks, logits_index):
        started.set()
        release.wait(60)
        return real(chunks, logits_index)

    runner.execute = stuck
    srv = InProcessServer(build_app({"tiny": engine}, health_step_timeout=0.2))
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    clients = [threading.Thread(target=srv.post, args=("/v1/completions",), kwargs={"json": body}) for _ in range(2)]
    try:
        clients[0].start()
        assert started.wait(30)
        time.sleep(0.4)
        assert health(srv).status_code == 200  # past the bound, but nothing waits behind it
        clients[1].start()
        deadline = time.monotonic() + 30
        while (r := health(srv)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 503 and "step has run" in r.json()["error"]["message"]
        release.set()
        for c in clients:
            c.join(60)
        assert health(srv).status_code == 200
    finally:
        release.set()
        srv.stop()
        engine.shutdown()


def health(srv: InProcessServer) -> httpx.Response:
    return httpx.get(f"{srv.url}/health", timeout=10)
