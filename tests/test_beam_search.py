"""In-engine beam search: same best sequence as HF transformers' `generate(num_beams=k)`; beams share blocks."""
from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams

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
