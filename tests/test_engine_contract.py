"""The engine contract (engine/protocol.py, engine/errors.py, engine/input_processor.py): outputs are deltas that
fold into the whole answer, stop strings are cut and held back by the engine, errors keep their code and field
across the wire and map to one OpenAI error each, and a request is checked once."""
from __future__ import annotations

import asyncio
import pickle

import pytest

from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.errors import (
    _BY_CODE,
    AdmissionError,
    ChatTemplateError,
    ConstraintError,
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    WireError,
    as_engine_error,
)
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.protocol import CompletionDelta, EngineOutput, OutputAccumulator, merge_outputs
from pagedlm.outputs import Logprob
from pagedlm.sampling.params import SamplingParams
from pagedlm.server.errors import ERRORS, api_error
from pagedlm.server.protocol import Unavailable

PROMPT = "Once upon a time, there was"
SAMPLED = dict(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)


def run(engine: LLMEngine, rid: str, params: SamplingParams) -> list[EngineOutput]:
    engine.add_request(rid, PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_outputs_are_deltas_that_fold_into_the_answer(engine, tiny_model_dir):
    """Each step's output carries only the token it added (and its logprobs); the prompt comes once, with the
    first; folded together they are the answer `LLM.generate` gives."""
    from pagedlm import LLM

    params = SamplingParams(**SAMPLED, logprobs=2)
    outs = run(engine, "d", params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * SAMPLED["max_tokens"]
    assert all(len(o.outputs[0].logprobs) == 1 for o in outs)
    assert outs[0].prompt_token_ids == engine.tokenizer.encode(PROMPT)
    assert all(o.prompt_token_ids is None for o in outs[1:])
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].stats.num_generation_tokens == SAMPLED["max_tokens"] and outs[-1].stats.finish_reasons == ["length"]
    acc = OutputAccumulator("d")
    for o in outs:
        acc.add(o)
    whole = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64).generate(
        PROMPT, SamplingParams(**SAMPLED, logprobs=2), use_tqdm=False)[0].outputs[0]
    got = acc.output().outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (whole.token_ids, whole.text, "length")
    assert [sorted(e) for e in got.logprobs] == [sorted(e) for e in whole.logprobs]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_steps_is_held_back_by_the_engine(engine, include):
    """A stop string that starts inside one step's text and ends in a later step's: the text before it streams,
    its start is held back, and nothing of it reaches the output unless asked (include_stop_str_in_output)."""
    free = run(engine, "free", SamplingParams(**SAMPLED))
    pieces = [o.outputs[0].text for o in free]
    full = "".join(pieces)
    needle = None
    for k in range(len(pieces) // 2, len(pieces) - 2):
        start = len("".join(pieces[:k])) + len(pieces[k]) - 1  # the last character of step k's text
        cand = full[start:start + 4]
        if len(pieces[k]) > 1 and len(cand) == 4 and full.index(cand) == start and "\ufffd" not in cand:
            needle = cand
            break
    assert needle is not None, f"no stop string across steps in {pieces!r}"
    outs = run(engine, "stop", SamplingParams(**SAMPLED, stop=[needle], include_stop_str_in_output=include))
    texts = [o.outputs[0].text for o in outs]
    cut = full.index(needle) + (len(needle) if include else 0)
    assert "".join(texts) == full[:cut]
    assert sum(1 for t in texts if t) > 1  # it streamed
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", needle)


def test_pending_outputs_merge_in_order():
    lp = {5: Logprob(-0.1)}
    a = EngineOutput("r", [CompletionDelta(0, [5], "he", [lp], -0.1), CompletionDelta(1, [6], "x", [lp], -1.0)],
                     prompt_token_ids=[1, 2], num_cached_tokens=1)
    b = EngineOutput("r", [CompletionDelta(0, [7], "llo", [lp], -0.3, "stop", "!")])
    c = EngineOutput("r", [CompletionDelta(1, [8, 9], "yz", [lp, lp], -2.0, "length")], finished=True)
    m = merge_outputs([a, b, c])
    assert m.finished and m.prompt_token_ids == [1, 2] and m.num_cached_tokens == 1
    d0, d1 = m.outputs
    assert (d0.token_ids, d0.text, len(d0.logprobs), d0.finish_reason, d0.stop_reason) == ([5, 7], "hello", 2, "stop",
                                                                                          "!")
    assert (d1.token_ids, d1.text, d1.cumulative_logprob, d1.finish_reason) == ([6, 8, 9], "xyz", -2.0, "length")
    assert a.outputs[0].token_ids == [5]  # the merged parts are left as they were
    acc = OutputAccumulator("r")
    for out in (a, b, c):
        acc.add(out)
    whole = acc.output()
    assert [(o.index, o.token_ids, o.text) for o in whole.outputs] == [(0, [5, 7], "hello"), (1, [6, 8, 9], "xyz")]
    assert whole.finished and whole.prompt_token_ids == [1, 2]


def test_engine_errors_keep_code_and_param_across_the_wire():
    errors = [InvalidRequestError("bad", "logit_bias"), ContextLengthError("long", "prompt"), AdmissionError("n", "n"),
              ChatTemplateError("tpl"), QueueFullError("full"), EngineDeadError("dead"), RequestFailedError("fail"),
              ConstraintError("limit")]
    assert {type(e) for e in errors} == set(_BY_CODE.values())
    for e in errors:
        for back in (e.to_wire().error(), pickle.loads(pickle.dumps(e))):
            assert (type(back), back.message, back.param, back.code) == (type(e), e.message, e.param, e.code)
    assert (ChatTemplateError("tpl").param, ConstraintError("limit").param) == ("messages", "structured_outputs")
    assert isinstance(WireError("no-such-code", "?").error(), RequestFailedError)
    assert type(as_engine_error(ValueError("v"), "r")) is InvalidRequestError
    failed = as_engine_error(KeyError("secret detail"), "cmpl-1")
    assert isinstance(failed, RequestFailedError) and "KeyError" in str(failed) and "secret" not in str(failed)


def test_one_table_maps_engine_errors_to_openai_errors():
    assert set(ERRORS) == set(_BY_CODE)
    e = api_error(QueueFullError("full"))
    assert isinstance(e, Unavailable) and (e.status, e.code, e.headers) == (503, "queue_full", {"Retry-After": "1"})
    e = api_error(ContextLengthError("long", "prompt"))
    assert not isinstance(e, Unavailable) and (e.status, e.code, e.param) == (400, "context_length_exceeded", "prompt")
    e = api_error(InvalidRequestError("bad", "structured_outputs"), param="guided_json")
    assert (e.status, e.param, e.type) == (400, "guided_json", "invalid_request_error")
    assert (api_error(RequestFailedError("x")).status, api_error(EngineDeadError("x")).status) == (500, 503)
    e = api_error(ConstraintError("limit"))  # the client's constraint, stopped while it ran: not another model's to try
    assert not isinstance(e, Unavailable) and (e.status, e.code) == (400, "constraint_failed")


def test_a_request_is_checked_once(tiny_model_dir, monkeypatch):
    """The input processor's checks run once per request, on the caller's side; the engine thread only queues."""
    eng = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                         LoopConfig.offline(log_interval=0))
    calls = []
    processor = eng.input_processor
    for name in ("check_prompt", "check_params", "prepare_params"):
        real = getattr(processor, name)
        monkeypatch.setattr(processor, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))

    async def main():
        stream = await eng.add_request("once", PROMPT, SamplingParams(max_tokens=3, bad_words=["time"]))
        return await stream.result()

    try:
        out = asyncio.run(main())
    finally:
        eng.shutdown()
    assert len(out.outputs[0].token_ids) == 3
    assert calls == ["check_prompt", "check_params", "prepare_params"]


def test_a_stream_behind_keeps_its_outputs_merged():
    """Outputs nobody took yet merge: a consumer far behind takes them as one, and a stream nobody reads holds a
    bounded number of outputs (not one per step)."""
    from pagedlm.engine.client import MAX_PENDING, RequestStream

    async def main():
        stream = RequestStream(None, "r", asyncio.get_running_loop())
        for i in range(200):
            stream.put(EngineOutput("r", [CompletionDelta(0, [i], f"{i},")], finished=i == 199))
            assert len(stream._pending) < MAX_PENDING
        out = await stream.__anext__()
        assert stream.finished and stream.unread_since is None
        return out

    out = asyncio.run(main())
    assert out.finished and out.outputs[0].token_ids == list(range(200))
    assert out.outputs[0].text == "".join(f"{i}," for i in range(200))
