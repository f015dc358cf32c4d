"""The engine on a CUDA device gives what it gives on the CPU (runs only where a GPU exists)."""
from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32).get_tokenizer()
    texts = ["Hello! How are you today?", "The quick brown fox", "It was the best of times, " * 8,
             "What is the capital of France?"]
    return [tok.encode(t) for t in texts]


def run(tiny_model_dir, prompts, device, params=GREEDY, **kw):
    llm = LLM(str(tiny_model_dir), dtype="float32", device=device, **{"num_kv_blocks": 128, **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    return [[o.token_ids for o in r.outputs] for r in outs], llm.engine


def test_greedy_cuda_equals_cpu(tiny_model_dir, prompts):
    cpu, _ = run(tiny_model_dir, prompts, "cpu")
    gpu, eng = run(tiny_model_dir, prompts, "cuda")
    assert eng.runner.kv_cache.gpu.is_cuda
    assert gpu == cpu


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=7),
                                dict(num_kv_blocks=24, block_size=4, preemption_mode="swap", swap_space=2**20),
                                dict(num_kv_blocks=24, block_size=4)])
def test_cuda_chunked_prefill_and_preemption(tiny_model_dir, prompts, kw):
    ref, _ = run(tiny_model_dir, prompts, "cuda")
    got, eng = run(tiny_model_dir, prompts, "cuda", **kw)
    assert got == ref


def test_cuda_seeded_sampling_and_beams(tiny_model_dir, prompts):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    a, _ = run(tiny_model_dir, prompts, "cuda", params)
    b, _ = run(tiny_model_dir, prompts[:1], "cuda", params)
    assert a[0] == b[0]
    beams = SamplingParams(use_beam_search=True, beam_width=3, max_tokens=10, ignore_eos=True)
    cpu, _ = run(tiny_model_dir, prompts, "cpu", beams)
    gpu, _ = run(tiny_model_dir, prompts, "cuda", beams)
    assert gpu == cpu
