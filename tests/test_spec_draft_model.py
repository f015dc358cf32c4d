"""Speculative decoding with a draft model (spec/draft_model.py, docs/speculative.md): the draft's own KV cache kept
in step with each sequence (caught up, rolled back, evicted, freed), batched drafting, lossless greedy output with a
good and a bad draft, no leaked blocks in either cache, and a draft with another tokenizer refused at start-up."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_LLAMA, build_tiny_tokenizer
from engine_utils import Steps
from transformers import LlamaConfig, LlamaForCausalLM

from pagedlm import LLM, SamplingParams
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.spec.draft_model import DraftModel

REPEAT = "The engine schedules requests, batches prompts together, and streams generated tokens back. " * 3
VOCAB = 50


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def draft_config(model_dir, k=4, **kw):
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k,
            "disable_by_batch_size": 64, **kw}


def draft_bm(llm) -> BlockManager:
    return llm.engine.spec.drafter.bm


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    for bm in (llm.engine.block_manager, draft_bm(llm)):
        assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    assert llm.engine.spec.drafter.num_seqs == 0
    return [[o.token_ids for o in r.outputs] for r in outs]


# --- the draft cache against a model whose next token depends on every K/V it reads -------------------------------
def next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % VOCAB


def reference_draft(tokens: list[int], k: int) -> list[int]:
    out = []
    for _ in range(k):
        out.append(next_token(tokens + out))
    return out


class FakeForward:
    """A 'model' over a paged cache of token ids: its argmax is `next_token` of the ids at the slots the block
    table gives for positions 0..p, so a stale, missing or misplaced K/V changes its drafts."""

    def __init__(self, block_size: int) -> None:
        self.bs, self.slots, self.passes = block_size, {}, 0

    def slot(self, table, p):
        return table[p // self.bs] * self.bs + p % self.bs

    def __call__(self, chunks, logits_index):
        self.passes += 1
        flat = []
        for tokens, start, tables in chunks:
            for i, t in enumerate(tokens):
                self.slots[self.slot(tables[0], start + i)] = t
                flat.append((tables[0], start + i))
        logits = torch.zeros(len(logits_index), VOCAB + 5)
        logits[:, VOCAB:] = 2.0  # past the target's vocabulary: never drafted
        for r, f in enumerate(logits_index):
            table, p = flat[f]
            logits[r, next_token([self.slots[self.slot(table, q)] for q in range(p + 1)])] = 3.0
        return logits


class Seq:
    ids = iter(range(10**6))

    def __init__(self, prompt):
        self.seq_id, self.prompt_token_ids, self.output_token_ids = next(self.ids), list(prompt), []

    @property
    def tokens(self):
        return self.prompt_token_ids + self.output_token_ids


@pytest.mark.parametrize("seed", range(4))
def test_draft_cache_follows_the_sequences(seed):
    """Random prompts, drafts, accept lengths, steps without a draft or without verification, forks and ends: every
    draft is the model's greedy continuation of the sequence's true tokens, and every block comes back."""
    rng = random.Random(seed)
    fake = FakeForward(block_size=4)
    bm = BlockManager(num_blocks=400, block_size=4)
    drafter = DraftModel(fake, bm, VOCAB, max_model_len=160, max_num_batched_tokens=16)
    live = [Seq(rng.choices(range(VOCAB), k=rng.randrange(1, 40))) for _ in range(3)]
    for _ in range(60):
        seqs = rng.sample(live, rng.randrange(1, len(live) + 1))
        ks = [rng.randrange(1, 6) for _ in seqs]
        passes, held = fake.passes, [drafter.kv.get(s.seq_id) for s in seqs]
        catch_up = None if None in held else sum(max(len(s.tokens) - kv.stable, 1) for s, kv in zip(seqs, held))
        drafts = drafter.propose_batch(seqs, ks)
        for seq, k, draft in zip(seqs, ks, drafts):
            assert draft == reference_draft(seq.tokens, min(k, 160 - len(seq.tokens) + 1)), (seq.tokens, k)
        if catch_up is not None and catch_up <= 16:  # one pass catches them all up
            assert fake.passes - passes == max(len(d) for d in drafts)  # then one pass per draft position, for all
        for seq, draft in zip(seqs, drafts):
            if rng.random() < 0.2:
                continue  # not verified (its drafts found no room): the same tokens draft again
            a = rng.randrange(len(draft) + 1)
            correction = rng.choice([t for t in range(VOCAB) if a == len(draft) or t != draft[a]])
            seq.output_token_ids += draft[:a] + [correction]
        for seq in live:
            if seq not in seqs and rng.random() < 0.5:
                seq.output_token_ids.append(rng.randrange(VOCAB))  # a step without a draft (k 0, batch too large)
        op = rng.random()
        if op < 0.1:
            child = Seq(live[0].prompt_token_ids)  # a fork: a new sequence with the same tokens
            child.output_token_ids = list(live[0].output_token_ids)
            live.append(child)
        elif op < 0.25 or max(len(s.tokens) for s in live) > 150:
            live = [s for s in live if len(s.tokens) <= 150 and rng.random() < 0.7] or \
                [Seq(rng.choices(range(VOCAB), k=rng.randrange(1, 40)))]
            drafter.retain(s.seq_id for s in live)
        assert set(drafter.kv) <= {s.seq_id for s in live}
    drafter.retain(())
    assert bm.num_free_blocks == bm.num_total_blocks


def test_full_draft_cache_evicts_the_least_recent():
    fake = FakeForward(block_size=4)
    bm = BlockManager(num_blocks=12, block_size=4)  # 48 slots
    drafter = DraftModel(fake, bm, VOCAB, max_model_len=100, max_num_batched_tokens=64)
    a, b, c = Seq(range(1, 19)), Seq(range(2, 20)), Seq(range(3, 21))
    assert drafter.propose_batch([a], [3]) == [reference_draft(a.tokens, 3)]
    assert drafter.propose_batch([b], [3]) == [reference_draft(b.tokens, 3)]
    assert drafter.propose_batch([c], [3]) == [reference_draft(c.tokens, 3)]  # a (drafted first) made room
    assert list(drafter.kv) == [b.seq_id, c.seq_id]
    assert drafter.propose_batch([b, c], [40, 3]) == [[], reference_draft(c.tokens, 3)]  # b cannot fit 57 tokens
    drafter.retain(())
    assert bm.num_free_blocks == bm.num_total_blocks


# --- the engine ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """Another random tiny LLaMA with the same tokenizer (one layer, untied embeddings: it rarely agrees)."""
    path = tmp_path_factory.mktemp("tiny_llama_draft")
    tok = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=None,
                         **{**TINY_LLAMA, "num_hidden_layers": 1, "tie_word_embeddings": False})
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(tiny_2k_model_dir):
    """The target: a tiny LLaMA with untied embeddings (a tied one's greedy answer repeats one token, which any draft
    guesses), its prompts and greedy answers without speculation."""
    llm = LLM(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in (REPEAT, "Hello! How are you today?", "Once upon a time, there was " * 4)]
    gen = lambda p: [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, p, use_tqdm=False)]  # noqa: E731
    return prompts, gen(greedy()), gen(greedy(n=3, max_tokens=16))


@pytest.mark.parametrize("kw", [
    dict(num_kv_blocks=256), dict(num_kv_blocks=256, max_num_batched_tokens=7),
    dict(num_kv_blocks=64, preemption_mode="recompute", max_num_batched_tokens=64),
    dict(num_kv_blocks=64, preemption_mode="swap", swap_space=2**20, max_num_batched_tokens=64),
], ids=["default", "chunked-prefill", "preempt-recompute", "preempt-swap"])
def test_greedy_identical_with_itself_as_draft(tiny_2k_model_dir, reference, kw):
    """The target as its own draft: (nearly) every draft is accepted, and the output is the same as without."""
    prompts, expected, expected_n3 = reference
    llm = LLM(str(tiny_2k_model_dir), dtype="float32", block_size=4, speculative_config=draft_config(tiny_2k_model_dir),
              **kw)
    assert run(llm, prompts, greedy()) == expected
    assert run(llm, prompts, greedy(n=3, max_tokens=16)) == expected_n3
    st = llm.engine.get_stats().spec_decode
    assert st.num_drafts > 0 and st.acceptance_rate > 0.9, st
    assert st.accepted_per_pos[0] > 0 and len(st.accepted_per_pos) == 4
    if "preemption_mode" in kw:
        assert llm.engine.scheduler.num_preemptions > 0, "the test must force preemption"


def test_greedy_identical_with_a_bad_draft(tiny_2k_model_dir, other_draft_dir, reference):
    """Another model drafts every step (not adaptive): most drafts are rejected and rolled back, in both caches,
    and the output is still the target's."""
    prompts, expected, expected_n3 = reference
    llm = LLM(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=256, block_size=4,
              speculative_config=draft_config(other_draft_dir, k=3, adaptive=False))
    assert run(llm, prompts, greedy()) == expected
    assert run(llm, prompts, greedy(n=3, max_tokens=16)) == expected_n3
    st = llm.engine.get_stats().spec_decode
    assert st.num_draft_tokens > 100 and st.num_accepted_tokens < st.num_draft_tokens / 2, st


def test_sliding_window_draft(tmp_path_factory):
    """Gemma 3 drafting for itself: KV cache groups with sliding windows in the draft's cache too."""
    from conftest import build_tiny_gemma3

    path = build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_draft"), sliding_window=8,
                             max_position_embeddings=256)
    base = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    prompts = [base.get_tokenizer().encode("Once upon a time, there was " * 3)]
    expected = [[o.token_ids for o in r.outputs] for r in base.generate(prompts, greedy(), use_tqdm=False)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config=draft_config(path))
    assert llm.engine.spec.drafter.bm.has_sliding
    assert run(llm, prompts, greedy()) == expected
    assert llm.engine.get_stats().spec_decode.acceptance_rate > 0.9


def test_abort_and_sampling_free_both_caches(tiny_2k_model_dir):
    llm = LLM(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=256, block_size=4,
              speculative_config=draft_config(tiny_2k_model_dir))
    engine, drafter = llm.engine, llm.engine.spec.drafter
    prompt = llm.get_tokenizer().encode(REPEAT)
    engine.add_request("a", prompt, greedy(max_tokens=40))
    engine.add_request("b", prompt, SamplingParams(temperature=0.8, max_tokens=40, n=2, ignore_eos=True, seed=3))
    steps = Steps(engine)
    steps.run(max_steps=4)
    assert drafter.num_seqs == 3 and draft_bm(llm).num_free_blocks < draft_bm(llm).num_total_blocks
    engine.abort_request("a")
    assert drafter.num_seqs == 2
    done = steps.run()
    assert len(done["b"].outputs) == 2 and all(len(o.token_ids) == 40 for o in done["b"].outputs)
    for bm in (engine.block_manager, draft_bm(llm)):
        assert bm.num_free_blocks == bm.num_total_blocks
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0


def test_draft_with_another_tokenizer_is_refused(tiny_2k_model_dir, tmp_path):
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    config = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=None, **TINY_LLAMA)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        LLM(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=64, speculative_config=draft_config(tmp_path))
