"""Automatic prefix caching: outputs never change, reuse really happens, eviction is LRU and tail-first."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from engine_utils import Steps

from pagedlm import LLM, SamplingParams
from pagedlm.kvcache.block_manager import BlockManager

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@dataclass(eq=False)
class Seq:
    seq_id: int
    tokens: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def admit(bm: BlockManager, seq: Seq) -> list[int]:
    hit = bm.find_cached_prefix(seq)
    seq.num_computed_tokens = len(hit) * bm.block_size
    bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens, hit)
    bm.commit(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return hit


def test_block_manager_reuses_verifies_and_evicts_tail_first():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = Seq(0, list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    assert admit(bm, a) == []
    b = Seq(1, list(range(9)) + [99])  # same first two blocks
    hit = admit(bm, b)
    assert hit == bm.get_block_table(a)[:2] and bm.gpu.ref_counts[hit[0]] == 2
    c = Seq(2, list(range(8)))  # exactly two full blocks: the last one is recomputed, so one hit
    assert admit(bm, c) == bm.get_block_table(a)[:1]
    salted = Seq(3, list(range(10)), cache_salt="tenant-b")
    assert admit(bm, salted) == []  # a different salt never shares
    for s in (a, b, c, salted):
        bm.free(s)
    assert bm.gpu.num_free == 8
    # freed blocks stay findable until their memory is needed
    d = Seq(4, list(range(12)))
    assert len(admit(bm, d)) == 2
    bm.free(d)
    # fill the pool with other content: the tail of a chain goes before its head
    e = Seq(5, [1000 + i for i in range(4 * 6)])
    admit(bm, e)
    f = Seq(6, list(range(12)))
    hit = bm.find_cached_prefix(f)
    assert len(hit) in (1, 2)  # the head block of the chain survived longest


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = Seq(0, [1, 2, 3])
    admit(bm, a)
    h = bm.seq_hashes[0][0]
    # forge: the same hash pointing at a block whose stored tokens differ
    bm.gpu.block_tokens[bm.gpu.cached[h]] = [7, 7]
    assert bm.find_cached_prefix(Seq(1, [1, 2, 5])) == []


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    system = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 3
    shared = [tok.encode(system + q) for q in ["Hello!", "What is the capital of France?", "The quick brown fox"]]
    identical = [tok.encode("Once upon a time, there was a little girl")] * 3
    return shared + identical


def run(tiny_model_dir, prompts, sequential: bool, **kw):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, **kw)
    if sequential:
        outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize("sequential", [True, False])
def test_caching_changes_no_output(tiny_model_dir, prompts, sequential):
    off, _ = run(tiny_model_dir, prompts, sequential, num_kv_blocks=128, enable_prefix_caching=False)
    on, eng = run(tiny_model_dir, prompts, sequential, num_kv_blocks=128)
    assert on == off
    stats = eng.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_hits < stats.prefix_cache_queries
    assert eng.block_manager.num_free_blocks == 128


def test_caching_after_evictions(tiny_model_dir, prompts):
    off, _ = run(tiny_model_dir, prompts * 2, True, num_kv_blocks=64, enable_prefix_caching=False)
    on, eng = run(tiny_model_dir, prompts * 2, True, num_kv_blocks=40)  # too small to keep everything cached
    assert on == off
    assert eng.get_stats().prefix_cache_hits > 0


def test_partial_block_prefix(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=64)
    base = llm.get_tokenizer().encode("The engine schedules requests, batches prompts together, and streams")
    ref = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    for cut in (len(base), len(base) - 1, len(base) - 2, 9, 8, 7):  # full, partial and exact block boundaries
        p = base[:cut]
        got = llm.generate(p, GREEDY, use_tqdm=False)[0]
        want = ref.generate(p, GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, cut
    assert llm.engine.get_stats().prefix_cache_hits > 0


def test_cache_hit_reported_and_prompt_logprobs_unaffected(tiny_model_dir, prompts):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=64)
    llm.generate(prompts[0], GREEDY, use_tqdm=False)
    second = llm.generate(prompts[1], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    lp = llm.generate(prompts[1], params, use_tqdm=False)[0].prompt_logprobs
    assert len(lp) == len(prompts[1]) and all(e is not None for e in lp[1:])


def test_failed_step_leaves_no_cached_blocks(tiny_model_dir, monkeypatch):
    """A forward pass that raises after scribbling over the KV it was to write (a kernel's range error): the
    blocks it scheduled are not served from the prefix cache afterwards. The prompt is prefilled in chunks of 8
    tokens and the second chunk fails: a retry reuses the first chunk's two blocks (written by a step that
    succeeded), none of the failed chunk's, and its greedy output is a clean run's."""
    from pagedlm.engine.llm_engine import LLMEngine

    kw = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
              attention_backend="reference")
    engine = LLMEngine.from_args(str(tiny_model_dir), **kw)
    prompt = engine.tokenizer.encode("It was the best of times, it was the worst of times, it was the age of")
    assert len(prompt) > 17
    clean = LLMEngine.from_args(str(tiny_model_dir), **kw, enable_prefix_caching=False)
    want = generate(clean, "clean", prompt)

    real, calls = engine.runner.execute, []

    def failing(chunks, logits_index):
        calls.append(len(chunks))
        if len(calls) == 2:
            kv = engine.runner.kv_cache.gpu
            for chunk in chunks:
                for block in chunk.block_tables[0][chunk.start // 4:]:
                    kv[:, :, block] = 1e3 * torch.randn_like(kv[:, :, block])
            raise RuntimeError("injected fault")
        return real(chunks, logits_index)

    monkeypatch.setattr(engine.runner, "execute", failing)
    engine.add_request("first", prompt, GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    engine.abort_request("first")  # what the server's engine loop does with the requests of a failed step
    assert not engine.has_unfinished_requests()
    out = generate(engine, "retry", prompt)
    assert out.num_cached_tokens == 8
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def generate(engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, GREEDY)
    return Steps(engine).run()[request_id]


def test_a_cached_prefix_as_big_as_the_pool_is_admitted(tiny_model_dir):
    """A prompt whose cached prefix fills nearly the whole pool (max_num_seqs=1, a pool of one max_model_len):
    reviving every cached block at once plus the watermark cannot fit, so only the part that fits is reused and the
    rest recomputed in chunks. Before, the request waited forever while the engine spun."""
    from pagedlm.engine.llm_engine import LLMEngine

    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=65, max_num_seqs=1,
                              max_model_len=260, max_num_batched_tokens=32)
    prompt = [5 + i % 200 for i in range(256)]  # 64 blocks of 65, then 2 tokens in the 65th
    eng.block_manager.watermark_blocks = 2  # as in a pool of 200+ blocks (1%)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = []
    for k in range(2):
        eng.add_request(f"r{k}", prompt, params)
        for _ in range(200):
            if not eng.has_unfinished_requests():
                break
            for o in eng.step():
                if o.finished:
                    outs.append(o.outputs[0].token_ids)
        assert not eng.has_unfinished_requests(), f"request {k} never finished"
    assert outs[0] == outs[1] and eng.get_stats().prefix_cache_hits > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
