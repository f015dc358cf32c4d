"""Engine mechanics on the tiny random model: continuous batching, chunked prefill, preemption, abort, n>1.

Every optimized configuration is compared with an unoptimized reference run on the same inputs.
"""
from __future__ import annotations

import pytest
from engine_utils import Steps

from pagedlm import LLM, SamplingParams
from pagedlm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_prompts(tok, n=8):
    base = ["Hello! How are you today?", "The quick brown fox", "Once upon a time, there was",
            "What is the capital of France?", "It was the best of times, it was the worst of times, " * 6,
            "Numbers like 1, 2, 3", "A paged key value cache stores", "The engine schedules requests " * 10]
    return [tok.encode(p) for p in (base * 2)[:n]]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt alone, whole prompt in one step, ample memory: the unoptimized reference."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=4096)
    prompts = make_prompts(llm.get_tokenizer())
    return prompts, [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def run_batch(tiny_model_dir, prompts, **kw):
    llm = LLM(str(tiny_model_dir), dtype="float32", **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], eng


def test_batched_equals_alone(tiny_model_dir, reference):
    prompts, expected = reference
    got, _ = run_batch(tiny_model_dir, prompts, num_kv_blocks=256)
    assert got == expected


def test_chunked_prefill_tiny_budget(tiny_model_dir, reference):
    prompts, expected = reference
    got, eng = run_batch(tiny_model_dir, prompts, num_kv_blocks=256, max_num_batched_tokens=7)
    assert got == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_loses_nothing(tiny_model_dir, reference, mode):
    prompts, expected = reference
    got, eng = run_batch(tiny_model_dir, prompts, num_kv_blocks=36, block_size=4, preemption_mode=mode,
                         swap_space=2**20, max_num_batched_tokens=64)
    assert eng.scheduler.num_preemptions > 0, "the test must force preemption"
    assert got == expected
    if mode == "swap":
        assert eng.block_manager.cpu.num_free == eng.block_manager.cpu.num_blocks


def test_max_num_seqs_limits_concurrency(tiny_model_dir, reference):
    prompts, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=2)
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), p, GREEDY)
    done, steps = {}, Steps(llm.engine)
    while llm.engine.has_unfinished_requests():
        for out in steps.step():
            done[out.request_id] = out.outputs[0].token_ids
        assert llm.engine.get_stats().num_running <= 2
    assert [done[str(i)] for i in range(len(prompts))] == expected


def test_abort_frees_blocks(tiny_model_dir, reference):
    prompts, expected = reference
    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=4,
                              max_num_batched_tokens=16)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    steps = Steps(eng)
    for _ in range(5):
        assert steps.step() == []
    eng.abort_request(["0", "3", "5"])
    done = {rid: out.outputs[0].token_ids for rid, out in steps.run().items()}
    assert set(done) == {str(i) for i in range(len(prompts))} - {"0", "3", "5"}
    for rid, toks in done.items():
        assert toks == expected[int(rid)]
    assert eng.block_manager.num_free_blocks == 64


def test_invalid_requests_are_rejected_before_queueing(tiny_model_dir):
    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length"):
        eng.add_request("long", list(range(3, 80)), GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("bad", [10**9], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("t", [5, 6], SamplingParams(temperature=-1))
    eng.add_request("ok", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok", [5, 6], GREEDY)
    assert eng.get_num_unfinished_requests() == 1


def test_max_model_len_finishes_with_length(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_model_len=20)
    out = llm.generate([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 15 and out.finish_reason == "length"


def test_n_samples_share_prompt_blocks_and_match_separate_seeds(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=4)
    prompt = make_prompts(llm.get_tokenizer())[4]
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    eng = llm.engine
    eng.add_request("n", prompt, params)
    steps = Steps(eng)
    steps.step()  # prefill once, fork into 3 sequences sharing the prompt blocks
    req = eng.scheduler.running[0]
    assert len(req.seqs) == 3
    tables = [eng.block_manager.get_block_table(s) for s in req.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks == len(tables[0])
    together = [o.token_ids for o in steps.run()["n"].outputs]
    separate = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=123 + i, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]
    assert together == separate
    assert len({tuple(t) for t in together}) > 1
    assert eng.block_manager.num_free_blocks == 128


def test_seeded_sampling_is_batch_invariant(tiny_model_dir, reference):
    prompts, _ = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts[2], params, use_tqdm=False)[0].outputs[0].text
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts[:5], [others, others, params, others, others], use_tqdm=False)
    assert batch[2].outputs[0].text == alone


def test_stop_strings_and_token_ids(tiny_model_dir, reference):
    prompts, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    stop_tok = expected[0][5]
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[0][:expected[0].index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # a stop string from the second half of a seeded sample (the greedy texts repeat one token), first seen
    # after its start: the text ends right before it
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)
    whole = llm.generate(prompts[0], sampled, use_tqdm=False)[0].outputs[0]
    full = whole.text
    needle = next((full[i:i + 3] for i in range(len(full) // 2, len(full) - 3)
                   if full[i:i + 3].isalnum() and full.index(full[i:i + 3]) > 0), None)
    assert needle is not None, f"no stop string to take from {full!r}"
    out = llm.generate(prompts[0], SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True,
                                                  stop=[needle]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:full.index(needle)] and out.stop_reason == needle and out.finish_reason == "stop"
    assert len(out.token_ids) < len(whole.token_ids) and out.token_ids == whole.token_ids[:len(out.token_ids)]


def test_min_tokens_and_max_tokens(tiny_model_dir, reference):
    """EOS is forced (logit_bias): it ends a sequence at once, unless min_tokens holds it (and the stop token
    the model picks first) back."""
    prompts, expected = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    eos = next(iter(llm.engine.eos_token_ids))
    out = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[1][:5] and out.finish_reason == "length"
    forced = dict(temperature=0, max_tokens=12, logit_bias={eos: 100.0})
    out = llm.generate(prompts[1], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    params = SamplingParams(**forced, min_tokens=10, stop_token_ids=[expected[1][0]])
    out = llm.generate(prompts[1], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 11 and eos not in out.token_ids[:10] and expected[1][0] not in out.token_ids[:10]
    assert out.token_ids[10] == eos and out.finish_reason == "stop"


def test_prompt_logprobs_with_chunked_prefill(tiny_model_dir, reference):
    prompts, _ = reference
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    whole = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64).generate(prompts[4], params, use_tqdm=False)[0]
    chunked = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=5).generate(
        prompts[4], params, use_tqdm=False)[0]
    assert whole.prompt_logprobs[0] is None and len(whole.prompt_logprobs) == len(prompts[4])
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_memory_report(tiny_model_dir):
    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB")
    r = eng.memory_report
    assert r.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # 2 x layers x kv_heads x head_dim x fp32
    assert r.num_blocks == 2**20 // (r.kv_bytes_per_token * 16)
    assert r.tokens_capacity == r.num_blocks * 16
    assert "KV bytes per token" in r.format()


def test_abort_swapped_request_frees_host_blocks(tiny_model_dir, reference):
    prompts, expected = reference
    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=36, block_size=4,
                              preemption_mode="swap", swap_space=2**20, max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    steps = Steps(eng)
    while not eng.scheduler.swapped:
        steps.step()
    victim = eng.scheduler.swapped[0].request_id
    eng.abort_request(victim)
    done = {rid: out.outputs[0].token_ids for rid, out in steps.run().items()}
    assert set(done) == {str(i) for i in range(len(prompts))} - {victim}
    assert all(toks == expected[int(rid)] for rid, toks in done.items())
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and bm.cpu.num_free == bm.cpu.num_blocks
