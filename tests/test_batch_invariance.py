"""Real model (SmolLM2, fp32, greedy): each prompt gives the same tokens alone as inside a 16-request run
with chunked prefill under a tiny budget, and with preemption by recompute and by swap."""
from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams

pytestmark = pytest.mark.slow

TOPICS = ["the ocean", "prime numbers", "a red bicycle", "the French revolution", "photosynthesis",
          "a haunted lighthouse", "sorting algorithms", "the moon landing"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    llm = LLM(str(smollm2_path), dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    raw = [f"Here is a short story about {t}." + " It begins quietly." * (i * 7) for i, t in enumerate(TOPICS)]
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Tell me one fact about {t}."}]),
                        add_special_tokens=False) for t in TOPICS]
    ids = [tok.encode(r) for r in raw] + chats
    alone = [llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in ids]
    return ids, alone


@pytest.mark.parametrize("kwargs", [
    dict(num_kv_blocks=256, max_num_batched_tokens=13),
    dict(num_kv_blocks=40, block_size=16, preemption_mode="recompute"),
    dict(num_kv_blocks=40, block_size=16, preemption_mode="swap", swap_space="64MiB"),
], ids=["chunked-prefill", "recompute", "swap"])
def test_batch_invariance(smollm2_path, prompts, kwargs):
    ids, alone = prompts
    llm = LLM(str(smollm2_path), dtype="float32", **kwargs)
    outs = llm.generate(ids, PARAMS, use_tqdm=False)
    eng = llm.engine
    if "preemption_mode" in kwargs:
        assert eng.scheduler.num_preemptions > 0, "too many blocks: preemption never happened"
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


def test_default_plan_prompt_one_past_a_kernel_pass(smollm2_path):
    """The default (quantized) plan, a prompt of 257 tokens: its prefill's products run a last pass of one row after
    a full pass of 256 (csrc/quant_linear.cpp), which must read that row; the same prompt prefilled in chunks of 128
    never runs such a pass. Both give the same greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [100 + (i * 7919) % 40000 for i in range(257)]
    whole = LLM(str(smollm2_path), speculative_config=None)
    assert whole.engine.config.max_num_batched_tokens >= len(prompt)
    want = whole.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    chunked = LLM(str(smollm2_path), speculative_config=None, max_num_batched_tokens=128)
    assert chunked.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
