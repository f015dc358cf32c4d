"""Speculative decoding (docs/speculative.md): drafts verified in the batched step, lossless for greedy and sampled
requests, the rejected tail's KV slots returned, predicted outputs accounted, bad configuration refused."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.config import EngineConfig, SpeculativeConfig
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.spec.ngram import NgramProposer
from pagedlm.spec.prediction import PredictionProposer
from pagedlm.spec.state import SpecState

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}
REPEAT = "The engine schedules requests, batches prompts together, and streams generated tokens back. " * 3


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    return [[o.token_ids for o in r.outputs] for r in outs]


def spec_stats(llm):
    return llm.engine.get_stats().spec_decode


# --- proposers ------------------------------------------------------------------------------------------------
class Seq:
    def __init__(self, prompt, output=()):
        self.prompt_token_ids, self.output_token_ids = list(prompt), list(output)


def test_ngram_finds_the_longest_earlier_match():
    p = NgramProposer(1, 3)
    assert p.propose(Seq([1, 2, 3, 4, 5, 9, 2, 3]), 3) == [4, 5, 9]
    # the longest match wins over a later, shorter one: [7, 2, 3] -> 8
    assert p.propose(Seq([7, 2, 3, 8, 5, 2, 3, 6, 7, 2, 3]), 2) == [8, 5]
    assert p.propose(Seq([1, 2, 3], [4]), 3) == []  # 4 never occurred before
    assert NgramProposer(2, 3).propose(Seq([5, 1, 6, 1]), 2) == []  # only a 1-gram matches


def test_prediction_follows_the_output():
    p = PredictionProposer([10, 11, 12, 13, 14, 15, 16])
    assert p.propose(Seq([1], []), 3) == [10, 11, 12]
    assert p.propose(Seq([1], [10, 11, 12]), 2) == [13, 14]
    # the output inserted tokens, then copies the prediction again: it re-synchronises
    assert p.propose(Seq([1], [10, 11, 12, 13, 99, 98]), 2) == []
    assert p.propose(Seq([1], [10, 11, 12, 13, 99, 98, 14]), 2) == [15, 16]


def test_adaptive_k_follows_acceptance():
    state = SpecState(NgramProposer(1, 2), k_max=8)
    for _ in range(10):
        state.record(state.next_k(), state.next_k())  # everything accepted
    assert state.next_k() == 8
    for _ in range(10):
        state.record(4, 0)
    assert state.next_k() == 0  # paused
    assert [state.next_k() for _ in range(8)][-1] == 1  # then probes with one token


# --- greedy identity ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in (REPEAT, "Hello! How are you today?", "Once upon a time, there was " * 4)]
    return prompts, run(llm, prompts, greedy(n=1)), run(llm, prompts, greedy(n=3, max_tokens=16))


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=7), dict(enable_prefix_caching=False)],
                         ids=["default", "chunked-prefill", "no-prefix-cache"])
def test_greedy_identical_with_ngram_tiny(tiny_model_dir, tiny_reference, kw):
    prompts, expected, expected_n3 = tiny_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config=NGRAM, **kw)
    assert run(llm, prompts, greedy()) == expected
    assert run(llm, prompts, greedy(n=3, max_tokens=16)) == expected_n3
    st = spec_stats(llm)
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st


def test_greedy_identical_with_prediction_tiny(tiny_model_dir, tiny_reference):
    """The reference output as the prediction: every draft is accepted; a corrupted one: drafts are rejected and
    the output still matches."""
    prompts, expected, _ = tiny_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    for k, prompt in enumerate(prompts):
        exact = run(llm, [prompt], greedy(prediction=expected[k][0]))
        assert exact == [expected[k]]
        corrupt = list(expected[k][0])
        for i in range(3, len(corrupt), 5):
            corrupt[i] = (corrupt[i] + 7) % 500
        assert run(llm, [prompt], greedy(prediction=corrupt)) == [expected[k]]
    st = spec_stats(llm)
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens, st
