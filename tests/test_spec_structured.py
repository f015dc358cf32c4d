"""Speculative decoding of constrained requests (docs/speculative.md): a draft is cut before the first token the
grammar rejects, every draft position is verified under the grammar's mask at that position, and the matcher
holds the accepted output only. Greedy output is the same with and without drafts (n-gram, prediction, draft
model), and a draft token the grammar forbids is never emitted, even when it reaches the verifier."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from test_structured import SCHEMA

from pagedlm import LLM, SamplingParams
from pagedlm.engine import sample as sample_module
from pagedlm.engine import spec_decode
from pagedlm.sampling.params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}
REGEX = r"[0-9]{3}-[a-z]{2,4}( [a-z]{2,5}){6}"
CONSTRAINTS = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
               StructuredOutputsParams(choice=["alpha beta gamma delta", "beta gamma"])]
# prompts that hold text of each constraint's shape: prompt lookup finds drafts the grammar allows
PROMPTS = ['{"name": "ab", "age": 3, "role": "user", "tags": ["a", "b"], "address": {"city": "x", "zip": "12345"}} '
           * 2, "123-ab cd ef gh ij kl mn " * 3, "alpha beta gamma delta " * 3]


def constrained(so, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 80, "structured_outputs": so, **kw})


def generate(llm, prompts, params) -> list:
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, "KV blocks leaked"
    return outs


def follows(so: StructuredOutputsParams, text: str) -> None:
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    else:
        assert text in so.choice, text


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    outs = generate(llm, PROMPTS, [constrained(so) for so in CONSTRAINTS])
    for so, o in zip(CONSTRAINTS, outs):
        follows(so, o.text)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("kw", [dict(num_kv_blocks=256), dict(num_kv_blocks=256, max_num_batched_tokens=7)],
                         ids=["default", "chunked-prefill"])
def test_greedy_constrained_identical_with_ngram(tiny_model_dir, reference, kw):
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, speculative_config=NGRAM, **kw)
    assert [o.token_ids for o in generate(llm, PROMPTS, [constrained(so) for so in CONSTRAINTS])] == reference
    st = llm.engine.get_stats().spec_decode
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st


def test_greedy_constrained_identical_with_prediction(tiny_model_dir, reference):
    """Each constrained request alone, its reference as the prediction: drafts run and are accepted."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    for prompt, so, expected in zip(PROMPTS, CONSTRAINTS, reference):
        before = llm.engine.get_stats().spec_decode.num_accepted_tokens
        out = generate(llm, [prompt], [constrained(so, prediction=expected)])[0]
        assert out.token_ids == expected
        assert llm.engine.get_stats().spec_decode.num_accepted_tokens - before >= len(expected) // 2


def test_greedy_constrained_identical_with_a_draft_model(tiny_2k_model_dir):
    """The draft model drafts unconstrained (its own argmax): its drafts are cut at the grammar."""
    plain = LLM(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    params = [constrained(so, max_tokens=40) for so in CONSTRAINTS]
    expected = [o.token_ids for o in generate(plain, PROMPTS, params)]
    spec = LLM(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config={
        "method": "draft_model", "model": str(tiny_2k_model_dir), "num_speculative_tokens": 3})
    assert [o.token_ids for o in generate(spec, PROMPTS, params)] == expected
    st = spec.engine.get_stats().spec_decode
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st
    assert spec.engine.spec.drafter.num_seqs == 0


def violating(manager, template, tokens: list[int], every: int = 4) -> list[int]:
    """`tokens` with every `every`-th one replaced by a token the grammar rejects after the ones before it."""
    out = list(tokens)
    for i in range(1, len(tokens), every):
        m = manager.replay(template, tokens[:i])
        out[i] = next(t for t in range(manager.vocab_size) if m.validate_tokens([t]) == 0)
    return out


@pytest.mark.parametrize("cut", [True, False], ids=["cut", "uncut"])
def test_a_draft_token_the_grammar_rejects_is_never_emitted(tiny_model_dir, reference, monkeypatch, cut):
    """A prediction with forbidden tokens spliced in: cut at the grammar, no forbidden draft reaches the verifier;
    uncut (the cut switched off), they reach it, and its per-position masks reject every one of them."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    mgr = llm.engine.structured
    if not cut:
        monkeypatch.setattr(spec_decode, "constrain", lambda seq: None)
    verified = []  # (output before the step, the drafts verified)
    real = sample_module.StepSampler._append_verified

    def spy(self, ctx, row, *args):
        verified.append((list(row.seq.output_token_ids), list(row.draft_token_ids)))
        return real(self, ctx, row, *args)

    monkeypatch.setattr(sample_module.StepSampler, "_append_verified", spy)
    forbidden = 0
    for prompt, so, expected in zip(PROMPTS[:2], CONSTRAINTS[:2], reference[:2]):
        template = mgr.compile(so)
        verified.clear()
        out = generate(llm, [prompt], [constrained(so, prediction=violating(mgr, template, expected))])[0]
        assert out.token_ids == expected
        follows(so, out.text)
        assert verified, "the prediction must draft"
        for output, drafts in verified:
            forbidden += len(drafts) - mgr.replay(template, output).validate_tokens(drafts)
    assert (forbidden == 0) if cut else (forbidden > 0)


def test_matcher_holds_the_accepted_output_only(tiny_model_dir, reference):
    """After every step of a speculating constrained request, its matcher is in the state of a fresh one replayed
    over its output (rejected drafts left no trace)."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config=NGRAM)
    engine, mgr = llm.engine, llm.engine.structured
    so = CONSTRAINTS[0]
    corrupt = list(reference[0])
    corrupt[5::6] = [(t + 3) % mgr.vocab_size for t in corrupt[5::6]]
    engine.add_request("r", PROMPTS[0], constrained(so, prediction=corrupt))
    seq = engine.scheduler.waiting[0].seqs[0]
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if seq.matcher is not None and not seq.status.finished:
            live = mgr.fill_bitmask([seq.matcher])
            assert torch.equal(live, mgr.fill_bitmask([mgr.replay(mgr.compile(so), seq.output_token_ids)]))
            checked += 1
    assert seq.output_token_ids == reference[0] and checked > 3
    st = engine.get_stats().spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st


def test_draft_masks_follow_the_drafts(tiny_model_dir):
    """fill_bitmask with drafts: row j is the mask after the first j drafts; the matcher's state is unchanged."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=16, block_size=4, speculative_config="off")
    mgr = llm.engine.structured
    tok = llm.get_tokenizer()
    template = mgr.compile(CONSTRAINTS[1])
    text = tok.encode("123-abc de fg", add_special_tokens=False)
    m, other = mgr.replay(template, text[:2]), mgr.replay(template, text[:1])
    drafts = text[2:7]
    masks = mgr.fill_bitmask([m, other], [drafts, []])
    assert masks.shape[0] == len(drafts) + 2
    for j in range(len(drafts) + 1):
        assert torch.equal(masks[j], mgr.fill_bitmask([mgr.replay(template, text[:2 + j])])[0]), j
    assert torch.equal(masks[-1], mgr.fill_bitmask([other])[0])
    assert torch.equal(mgr.fill_bitmask([m]), masks[:1])  # m is where it was
