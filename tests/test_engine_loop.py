"""The engine loop as the server sees it: a request submitted while the loop dies is answered, and /health tells
a step that stopped progressing from a live loop."""
from __future__ import annotations

import asyncio

import pytest

from pagedlm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.params import SamplingParams


def make_engine(path) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine.from_args(str(path), dtype="float32", num_kv_blocks=64), log_interval=0)


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
        stream = engine.submit("late", [40, 41, 42], SamplingParams(max_tokens=2))
        await asyncio.wait_for(stream.accepted(), timeout=10)

    with pytest.raises(EngineDeadError):
        asyncio.run(go())
    engine._thread.join(10)
    assert not engine._thread.is_alive() and not engine.is_running
