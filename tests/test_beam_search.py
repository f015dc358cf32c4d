"""Beam search: the BeamSearch bookkeeping on hand-made distributions (no model), then in the engine: same
best sequence as HF transformers' `generate(num_beams=k)`; beams share blocks."""
from __future__ import annotations

import math

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.sampling.beam_search import BeamSearch

EOS = 0


def logprobs(*rows: list[float]) -> torch.Tensor:
    """One row of next-token probabilities (token id = position) per live beam, as log-probabilities."""
    return torch.tensor(rows, dtype=torch.float64).log()


def first_step(search: BeamSearch, probs: list[float]):
    """The first step has one beam: the prompt's."""
    return search.step(logprobs(probs), [0.0], [[]])


def test_eos_among_the_first_width_candidates_finishes_a_hypothesis():
    search = BeamSearch(2, 1.0, False, max_tokens=10, eos_token_ids={EOS})
    chosen = first_step(search, [0.5, 0.3, 0.15, 0.05])  # EOS is the best continuation
    assert [(c.parent, c.token) for c in chosen] == [(0, 1), (0, 2)]  # the beams go on without it
    assert [c.logprob for c in chosen] == pytest.approx([math.log(0.3), math.log(0.15)])
    assert [(h.token_ids, h.eos) for h in search.finished] == [([EOS], True)]
    assert search.finished[0].logprob == pytest.approx(math.log(0.5)) and not search.done


def test_eos_outside_the_first_width_candidates_is_dropped():
    search = BeamSearch(2, 1.0, False, max_tokens=10, eos_token_ids={EOS})
    chosen = first_step(search, [0.15, 0.5, 0.3, 0.05])  # EOS ranks third, as in HF transformers
    assert [c.token for c in chosen] == [1, 2] and search.finished == []


def test_without_eos_ids_eos_is_an_ordinary_token():
    search = BeamSearch(2, 1.0, False, max_tokens=10, eos_token_ids=set())  # ignore_eos
    chosen = first_step(search, [0.5, 0.3, 0.15, 0.05])
    assert [c.token for c in chosen] == [EOS, 1] and search.finished == []


@pytest.mark.parametrize("length_penalty,best", [(1.0, ([1, 1], False)), (0.0, ([EOS], True))])
def test_length_penalty_ranks_the_hypotheses(length_penalty, best):
    """A short EOS hypothesis (log 0.3, 1 token) against two that hit max_tokens (log 0.2 and log 0.175, 2
    tokens): the score is logprob / length ** length_penalty, so 1.0 favours the long ones and 0.0 the short."""
    search = BeamSearch(2, length_penalty, False, max_tokens=2, eos_token_ids={EOS})
    chosen = first_step(search, [0.3, 0.5, 0.15, 0.05])
    assert [c.token for c in chosen] == [1, 2] and len(search.finished) == 1
    chosen = search.step(logprobs([0.05, 0.4, 0.35, 0.2], [0.1, 0.7, 0.1, 0.1]), [c.logprob for c in chosen],
                         [[1], [2]])
    assert chosen == [] and search.done  # every candidate reached max_tokens
    expected = {1.0: [([1, 1], math.log(0.2) / 2), ([1, 2], math.log(0.175) / 2)],
                0.0: [([EOS], math.log(0.3)), ([1, 1], math.log(0.2))]}[length_penalty]
    assert [h.token_ids for h in search.finished] == [t for t, _ in expected]
    assert [h.score for h in search.finished] == pytest.approx([s for _, s in expected])
    assert [(h.token_ids, h.eos) for h in search.best(1)] == [best]


@pytest.mark.parametrize("early_stopping", [True, False])
def test_early_stopping_ends_once_width_hypotheses_are_finished(early_stopping):
    """After step 2 two hypotheses are finished ([EOS] and [1, EOS]) while a running beam can still beat them
    (score log(0.3) / 2 > log(0.3)): early_stopping=True ends the search there, False goes on."""
    search = BeamSearch(2, 1.0, early_stopping, max_tokens=10, eos_token_ids={EOS})
    chosen = first_step(search, [0.3, 0.5, 0.15, 0.05])
    chosen = search.step(logprobs([0.3, 0.6, 0.06, 0.04], [0.1, 0.5, 0.2, 0.2]), [c.logprob for c in chosen],
                         [[1], [2]])
    assert [h.token_ids for h in search.finished] == [[1, EOS], [EOS]]
    assert search.done is early_stopping
    if early_stopping:
        assert chosen == []
    else:
        assert [(c.parent, c.token) for c in chosen] == [(0, 1), (1, 1)]
        assert chosen[0].logprob == pytest.approx(math.log(0.5 * 0.6))


def test_a_search_whose_beams_cannot_improve_stops():
    """early_stopping=False: once the best running beam, scored at the current length, is below the worst
    finished hypothesis, nothing can improve and the search is done."""
    search = BeamSearch(2, 1.0, False, max_tokens=10, eos_token_ids={EOS})
    chosen = first_step(search, [0.05, 0.5, 0.3, 0.15])
    search.step(logprobs([0.9, 0.04, 0.03, 0.03], [0.9, 0.04, 0.03, 0.03]), [c.logprob for c in chosen],
                [[1], [2]])
    assert [h.token_ids for h in search.finished] == [[1, EOS], [2, EOS]] and search.done

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "The three primary colors are",
           "To make a cup of tea, first", "import numpy as np\n", "The meaning of life is", "Water boils at"]


def beam(k, lp=1.0, es=False, max_tokens=16):
    return SamplingParams(n=1, use_beam_search=True, beam_width=k, max_tokens=max_tokens, length_penalty=lp,
                          early_stopping=es, temperature=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("k,lp,es", [(2, 1.0, False), (4, 0.6, True)])
def test_matches_hf_beam_search(smollm2_path, smollm2_hf, k, lp, es):
    llm = LLM(str(smollm2_path), dtype="float32", num_kv_blocks=256)
    tok = llm.get_tokenizer()
    hf = smollm2_hf
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, beam(k, lp, es), use_tqdm=False)  # all 8 beam searches batched together
    for ids, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        ref = hf.generate(torch.tensor([ids]), num_beams=k, do_sample=False, max_new_tokens=16, length_penalty=lp,
                          early_stopping=es)[0, len(ids):].tolist()
        # HF pads a finished sequence shorter than the batch's longest with eos/pad
        assert ref[:len(ours)] == ours, (tok.decode(ids), ours, ref)
    assert llm.engine.block_manager.num_free_blocks == 256


def test_beams_share_blocks_and_free_them(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=4)
    eng = llm.engine
    prompt = llm.get_tokenizer().encode("It was the best of times, it was the worst of times, " * 3)
    eng.add_request("b", prompt, beam(4, max_tokens=12))
    peak_shared = 0
    while eng.has_unfinished_requests():
        eng.step()
        req = eng._requests.get("b")
        if req is None:
            break
        tables = [eng.block_manager.get_block_table(s) for s in req.live_seqs]
        used = eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks
        if len(tables) > 1:
            assert used < sum(len(t) for t in tables), "beams must share their common history's blocks"
            peak_shared = max(peak_shared, sum(len(t) for t in tables) - used)
    assert peak_shared >= len(prompt) // 4
    assert eng.block_manager.num_free_blocks == 128


def test_beam_width_one_is_greedy(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    p = llm.get_tokenizer().encode("Once upon a time")
    greedy = llm.generate(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    b = llm.generate(p, SamplingParams(use_beam_search=True, beam_width=1, max_tokens=10, ignore_eos=True),
                     use_tqdm=False)[0]
    assert b.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_beam_search_survives_tiny_budget_and_preemption(tiny_model_dir):
    p = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64).get_tokenizer().encode("The quick brown fox " * 4)
    ref = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128).generate(
        [p, p], beam(3, max_tokens=10), use_tqdm=False)
    for kw in (dict(max_num_batched_tokens=5), dict(num_kv_blocks=20, block_size=4, preemption_mode="swap",
                                                    swap_space=2**20)):
        llm = LLM(str(tiny_model_dir), dtype="float32", **{"num_kv_blocks": 128, **kw})
        outs = llm.generate([p, p], beam(3, max_tokens=10), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks
