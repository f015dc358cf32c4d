"""Sliding-window layers free the blocks that left their window: a tiny random Gemma 3 (window 16, blocks of 4,
4 sliding and 2 full layers: KV cache groups of 2 layers) gives the same greedy tokens with freeing as without
it and as HF transformers, under chunked prefill and preemption, and its sliding blocks per sequence stay bounded."""
from __future__ import annotations

import random

import pytest
import torch
from engine_utils import Steps
from hf_reference import hf_greedy

from pagedlm import LLM, SamplingParams
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.kvcache.block_manager import NULL_BLOCK, BlockManager

WINDOW, BS = 16, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_swa_dir(tmp_path_factory):
    from conftest import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_swa"), sliding_window=WINDOW,
                             layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                             max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference(tiny_swa_dir):
    """Each prompt alone, in one chunk, ample memory, sliding-window freeing off."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 70, 23, 90, 10, 57)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockManager, "free_skipped_blocks", lambda self, seq: None)
        llm = LLM(str(tiny_swa_dir), dtype="float32", num_kv_blocks=2048, block_size=BS, max_num_batched_tokens=4096)
        expected = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return prompts, expected


def run(tiny_swa_dir, prompts, **kw):
    llm = LLM(str(tiny_swa_dir), dtype="float32", block_size=BS, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    assert bm.cpu.num_free == bm.cpu.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_groups_and_reference_matches_hf(tiny_swa_dir, reference):
    from transformers import AutoModelForCausalLM

    prompts, expected = reference
    eng = LLMEngine.from_args(str(tiny_swa_dir), dtype="float32", num_kv_blocks=64, block_size=BS)
    groups = eng.runner.kv_spec.groups
    assert [(g.layers, g.sliding_window) for g in groups] == [((0, 1), 16), ((3, 4), 16), ((2, 5), None)]
    assert eng.runner.kv_cache.gpu.shape[:3] == (2, 2, 64)
    assert not eng.block_manager.enable_prefix_caching
    hf = AutoModelForCausalLM.from_pretrained(tiny_swa_dir, dtype=torch.float32).eval()
    for p, exp, (hf_tokens, _) in zip(prompts, expected, hf_greedy(hf, prompts, GREEDY.max_tokens)):
        assert exp == hf_tokens


@pytest.mark.parametrize("kwargs", [
    {"num_kv_blocks": 2048},
    {"num_kv_blocks": 2048, "max_num_batched_tokens": 7},
    {"num_kv_blocks": 80, "max_num_batched_tokens": 16, "preemption_mode": "recompute"},
    {"num_kv_blocks": 80, "max_num_batched_tokens": 16, "preemption_mode": "swap", "swap_space": 2**20},
], ids=["batched", "chunked-prefill", "recompute", "swap"])
def test_freeing_changes_no_output(tiny_swa_dir, reference, kwargs):
    prompts, expected = reference
    got, eng = run(tiny_swa_dir, prompts, **kwargs)
    if "preemption_mode" in kwargs:
        assert eng.scheduler.num_preemptions > 0, "the test must force preemption"
    assert got == expected


def test_n_samples_and_beam_search_with_freed_blocks(tiny_swa_dir, reference):
    prompts, _ = reference
    llm = LLM(str(tiny_swa_dir), dtype="float32", num_kv_blocks=512, block_size=BS, max_num_batched_tokens=16)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts[1], params, use_tqdm=False)[0].outputs]
    separate = [llm.generate(prompts[1], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=30, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert together == separate
    beam = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=20, ignore_eos=True)
    ref = LLM(str(tiny_swa_dir), dtype="float32", num_kv_blocks=2048, block_size=BS).generate(
        prompts[3], beam, use_tqdm=False)[0]
    out = llm.generate(prompts[3], beam, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks


def test_sliding_blocks_per_sequence_stay_bounded(tiny_swa_dir, reference):
    """A 90-token prompt in chunks of 8, then decoding: every sliding group keeps at most the window before the
    chunk, the chunk and one partly used block; the full group keeps everything."""
    prompts, expected = reference
    chunk = 8
    eng = LLMEngine.from_args(str(tiny_swa_dir), dtype="float32", num_kv_blocks=256, block_size=BS,
                              max_num_batched_tokens=chunk)
    eng.add_request("r", prompts[3], GREEDY)
    peak_used, steps = 0, Steps(eng)
    while eng.has_unfinished_requests():
        outs = steps.step()
        req = eng._requests.get("r")
        if req is None:
            break
        seq = req.seqs[0]
        eng.block_manager.free_skipped_blocks(seq)  # what the next schedule() does first
        tables = eng.block_manager.get_block_tables(seq)
        full = -(-seq.num_computed_tokens // BS)
        for table, window in zip(tables, eng.block_manager.sliding_windows):
            live = [b for b in table if b != NULL_BLOCK]
            if window is None:
                assert len(live) == full
            else:
                assert len(live) <= -(-(WINDOW - 1 + 1) // BS) + 1
        used = eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks
        assert used == sum(len([b for b in t if b != NULL_BLOCK]) for t in tables)
        peak_used = max(peak_used, used)
    assert outs[0].outputs[0].token_ids == expected[3]
    total = len(prompts[3]) + GREEDY.max_tokens
    assert peak_used <= -(-total // BS) + 2 * (-(-(chunk + WINDOW - 1) // BS) + 1)
    assert peak_used < 3 * -(-total // BS) * 0.6  # versus every group keeping every block


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_with_freed_blocks(tiny_swa_dir, reference, kv_cache_dtype):
    """An int8/fp8 cache on a sliding-window model: chunked prefill + swap preemption + freeing give the tokens
    of the same cache dtype one prompt at a time without freeing."""
    prompts, _ = reference
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockManager, "free_skipped_blocks", lambda self, seq: None)
        llm = LLM(str(tiny_swa_dir), dtype="float32", num_kv_blocks=2048, block_size=BS, max_num_batched_tokens=4096,
                  kv_cache_dtype=kv_cache_dtype)
        expected = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    got, eng = run(tiny_swa_dir, prompts, num_kv_blocks=80, max_num_batched_tokens=16, preemption_mode="swap",
                   swap_space=2**20, kv_cache_dtype=kv_cache_dtype)
    assert eng.scheduler.num_preemptions > 0
    assert got == expected
