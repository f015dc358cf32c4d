"""Hardening: no request can hurt another. Engine-level isolation and limits here; the HTTP side is in
test_server_hardening.py."""
from __future__ import annotations

import pytest
import torch
from engine_utils import Steps

from pagedlm.engine.errors import AdmissionError, RequestFailedError
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.sampler import Sampler, SamplingRow

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=8,
                               attention_backend="reference")


def run(engine: LLMEngine, max_steps: int = 500) -> dict:
    done = Steps(engine).run(max_steps)
    assert not engine.has_unfinished_requests()
    return done


@pytest.mark.parametrize("kw", [
    dict(temperature=1e300), dict(temperature=float("inf")), dict(temperature=float("nan")), dict(temperature=2.5),
    dict(top_p=float("nan")), dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300),
    dict(min_p=float("nan")), dict(presence_penalty=float("nan")), dict(seed=2**64),
    dict(use_beam_search=True, beam_width=2, length_penalty=1e300),
    dict(use_beam_search=True, beam_width=2, length_penalty=-1e5), dict(length_penalty=float("nan")),
    dict(n=True), dict(logprobs=-1),
])
def test_extreme_sampling_params_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_tiny_top_p_keeps_the_top_token():
    """top_p=1e-300 is 0 in float32: the top token must stay (all -inf would give NaN probabilities)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=1e-300), [], []) for _ in range(4)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_greedy_tie_is_rank_one():
    """argmax takes the first of two equal logits; topk may list the other first: both are rank 1."""
    logits = torch.zeros(1, 1000)
    logits[0, 1] = logits[0, 999] = 5.0
    out = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0, logprobs=3), [], [])])
    entry = out.top_logprobs[0]
    assert out.token_ids == [1] and entry[1].rank == 1 and entry[999].rank == 1
    assert entry[1].logprob == pytest.approx(entry[999].logprob)
    assert sorted(e.rank for e in entry.values()) == [1, 1, 3]


def test_one_failing_request_does_not_fail_the_batch(engine):
    """A request whose beam scoring, sampling or detokenization raises ends alone with an error naming the
    failure class and its id; the greedy request beside it finishes exactly as it does alone."""
    alone = run_one(engine, "The quick brown fox")
    engine.add_request("ok", "The quick brown fox", SamplingParams(**GREEDY))
    engine.add_request("beam", "hi", SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2))
    engine.add_request("sampler", "Once upon", SamplingParams(temperature=0.8, max_tokens=8))
    engine.add_request("detok", "Hello", SamplingParams(**GREEDY))
    engine._requests["beam"].beam.length_penalty = 1e300  # past validation: gen_len ** 1e300 overflows
    engine._requests["sampler"].params.temperature = "hot"  # the batched sampler raises on this row
    engine._requests["detok"].seqs[0].detokenizer = None  # detokenizing its first token raises
    done = run(engine)
    assert done["ok"].error is None and done["ok"].outputs[0].text == alone
    for rid, cls in (("beam", "OverflowError"), ("sampler", "TypeError"), ("detok", "AttributeError")):
        assert isinstance(done[rid].error, RequestFailedError)
        assert str(done[rid].error) == f"The engine failed ({cls}) while running request {rid}; see the server log."
    assert all(o.outputs[0].finish_reason == "abort" for k, o in done.items() if k != "ok")
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not engine._requests


def run_one(engine: LLMEngine, prompt: str) -> str:
    engine.add_request("alone", prompt, SamplingParams(**GREEDY))
    return run(engine)["alone"].outputs[0].text


def test_batch_never_exceeds_max_num_seqs_after_forks(engine, monkeypatch):
    """Admission counts n before the fork: four n=8 requests under max_num_seqs=8 run one at a time, so no step
    samples more than 8 rows (they all forked at once before: 32 rows, the logits of 32 sequences)."""
    rows_per_step = []
    real = engine.step_sampler.sampler.__call__

    def spy(logits, rows):
        rows_per_step.append(len(rows))
        return real(logits, rows)

    monkeypatch.setattr(engine.step_sampler, "sampler", spy)
    for i in range(4):
        engine.add_request(f"n{i}", "Once upon a time", SamplingParams(n=8, temperature=1.0, max_tokens=3, seed=i))
    done = run(engine)
    assert max(rows_per_step) <= 8 and all(len(done[f"n{i}"].outputs) == 8 for i in range(4))


def test_request_limits(engine):
    cfg = engine.config
    cases = [SamplingParams(logprobs=cfg.max_logprobs + 1), SamplingParams(prompt_logprobs=cfg.max_logprobs + 1),
             SamplingParams(stop=[f"s{i}" for i in range(cfg.max_stop_sequences + 1)]),
             SamplingParams(stop_token_ids=list(range(cfg.max_stop_sequences + 1))),
             SamplingParams(stop=["x" * (cfg.max_stop_length + 1)])]
    for params in cases:
        with pytest.raises(ValueError, match="max_"):
            engine.add_request("limits", "Hello", params)
    assert not engine.has_unfinished_requests()
    engine.add_request("fits", "Hello", SamplingParams(logprobs=cfg.max_logprobs, max_tokens=2,
                                                       stop=["x" * cfg.max_stop_length] * cfg.max_stop_sequences))
    assert run(engine)["fits"].error is None


def test_admission_is_one_check(engine):
    """The engine refuses exactly what its input processor (the server's check) refuses, with the same error:
    forks that cannot fit in the KV cache together (128 blocks: 8 x 300 tokens do not, 8 x 100 do) and more
    sequences than max_num_seqs."""
    processor = engine.input_processor
    prompt = engine.tokenizer.encode("Hello")
    refused = [(SamplingParams(n=8, max_tokens=300), "n", "do not fit in the KV cache"),
               (SamplingParams(n=9, max_tokens=2), "n", "max_num_seqs"),
               (SamplingParams(use_beam_search=True, beam_width=9, max_tokens=2), "beam_width", "max_num_seqs")]
    for params, param, message in refused:
        with pytest.raises(AdmissionError, match=message) as server_side:
            processor.check_admission([len(prompt)], params)
        with pytest.raises(AdmissionError) as engine_side:
            engine.add_request("refused", prompt, params)
        assert str(engine_side.value) == str(server_side.value) and engine_side.value.param == param
    assert not engine.has_unfinished_requests()
    fits = SamplingParams(n=8, max_tokens=100)
    processor.check_admission([len(prompt)], fits)
    engine.add_request("fits", prompt, fits)
    assert engine.has_unfinished_requests()
    engine.abort_request("fits")
    assert not engine.has_unfinished_requests()
