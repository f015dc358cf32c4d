"""Token controls (logit_bias, allowed_token_ids, bad_words, max_tokens 0) and constrained decoding (llguidance)
in the sampler and the engine, on the tiny random model: outputs follow their constraint at temperature 1, and
greedy constrained outputs are the same alone, batched, chunked, forked and across preemption."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from engine_utils import Steps

from pagedlm import LLM, SamplingParams
from pagedlm.sampling import sampler as sampler_module
from pagedlm.sampling.params import MAX_LOGIT_BIAS_ENTRIES, StructuredOutputsParams
from pagedlm.sampling.sampler import Sampler, SamplingRow, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PROMPTS = ["The quick brown fox", "Once upon a time, there was", "Hello! How are you today?",
           "It was the best of times, it was the worst of times"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256)


def constrained(so: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 200, "structured_outputs": so, **kw})


# --- sampler ---------------------------------------------------------------------------------------------------
def test_logit_bias_allowed_and_bad_words_in_the_sampler():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    top = int(logits[0].argmax())
    rows = [SamplingRow(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=0.0, logit_bias={top: -100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[3, 9]), [1], []),
            SamplingRow(SamplingParams(temperature=1.0, allowed_token_ids=[11]), [1], [])]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == 7
    assert out.token_ids[1] != top and out.token_ids[1] == int(logits[1].topk(2).indices[1]) or \
        int(logits[1].argmax()) != top
    assert out.token_ids[2] == (3 if logits[2, 3] > logits[2, 9] else 9)
    assert out.token_ids[3] == 11
    # logprobs still describe the model's own distribution
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]), abs=1e-5)

    bad = SamplingParams(temperature=0.0)
    bad._bad_words_token_ids = [[top], [5, 6]]
    row0 = SamplingRow(bad, [1], [])
    assert Sampler()(logits[:1], [row0]).token_ids[0] != top
    boosted = logits[:1].clone()
    boosted[0, 6] = 1e4
    assert Sampler()(boosted, [SamplingRow(bad, [1], [4])]).token_ids[0] == 6  # 5 not last: 6 allowed
    assert Sampler()(boosted, [SamplingRow(bad, [1], [4, 5])]).token_ids[0] != 6  # "5 6" would complete


def test_grammar_mask_wins_when_the_controls_leave_nothing():
    logits = torch.zeros(1, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # only token 5
    row = SamplingRow(SamplingParams(temperature=1.0, allowed_token_ids=[6]), [1], [], bitmask=bitmask[0])
    assert Sampler()(logits, [row]).token_ids == [5]
    assert unpack_bitmask(bitmask, 40)[0].nonzero().flatten().tolist() == [5]
    assert unpack_bitmask(torch.full((1, 1), -1, dtype=torch.int32), 40)[0, 32:].any().item() is False


def test_token_control_validation():
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 100.5})
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, beam_width=2, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_engine_checks_token_ids_and_bans_bad_words(llm):
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias names token ids .*{vocab}"):
        eng.add_request("x", "Hello", SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        eng.add_request("x", "Hello", SamplingParams(allowed_token_ids=[1, vocab + 5]))
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    word = llm.engine.tokenizer.decode(free.token_ids[2:4])  # a two-token piece of the greedy output
    ids = llm.engine.tokenizer.encode(word, add_special_tokens=False)
    banned = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                      bad_words=[word]), use_tqdm=False)[0].outputs[0]
    seq = banned.token_ids
    assert seq != free.token_ids
    assert not any(seq[i:i + len(ids)] == ids for i in range(len(seq))), (word, ids, seq)
    allowed = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3,
                                                       allowed_token_ids=[40, 41, 42]), use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {40, 41, 42}
    forced = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                      logit_bias={77: 100}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [77] * 4


def test_allowed_token_ids_bounded_deduplicated_and_masked_once(llm, monkeypatch):
    """More ids than the vocabulary is refused before anything is queued; duplicates are dropped; the mask is
    built once per request (not per row per step): 2 prompts x n=3 x 5 tokens share one."""
    eng, vocab = llm.engine, llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="allowed_token_ids holds"):
        eng.add_request("huge", "Hello", SamplingParams(allowed_token_ids=[40] * (vocab + 1)))
    assert not eng.has_unfinished_requests()
    built = []
    real = sampler_module.build_allowed_mask
    monkeypatch.setattr(sampler_module, "build_allowed_mask", lambda ids, v: built.append(len(ids)) or real(ids, v))
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=2, n=3,
                            allowed_token_ids=[42, 40, 42, 41, 40] * 50)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert all(set(o.token_ids) <= {40, 41, 42} and len(o.token_ids) == 5 for out in outs for o in out.outputs)
    assert params.allowed_token_ids == [42, 40, 41] and built == [3]


def test_max_tokens_zero_scores_the_prompt(llm):
    prompt = llm.engine.tokenizer.encode(PROMPTS[1])
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=0, prompt_logprobs=1, n=2), use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [[], []]
    assert {o.finish_reason for o in out.outputs} == {"length"}
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    ref = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert [e and e[t].logprob for e, t in zip(out.prompt_logprobs, prompt)] == \
        [e and e[t].logprob for e, t in zip(ref.prompt_logprobs, prompt)]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_total_blocks


# --- constrained decoding ----------------------------------------------------------------------------------------
def test_json_schema_outputs_validate_at_temperature_one(llm):
    params = SamplingParams(temperature=1.0, max_tokens=256, n=6, seed=7,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    texts = [o.text for out in outs for o in out.outputs]
    assert len(texts) == 12 and len(set(texts)) > 6, texts  # really sampled, not one fixed answer
    for out in outs:
        for o in out.outputs:
            assert o.finish_reason == "stop", o
            jsonschema.validate(json.loads(o.text), SCHEMA)


def test_json_object_regex_choice_and_grammars(llm):
    def texts(so, n=4):
        outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=120, n=n, seed=11,
                                                        structured_outputs=so), use_tqdm=False)
        assert all(o.finish_reason == "stop" for o in outs[0].outputs), outs[0].outputs
        return [o.text for o in outs[0].outputs]

    for t in texts(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t), t
    choices = ["yes", "no", "maybe later"]
    got = texts(StructuredOutputsParams(choice=choices), n=8)
    assert set(got) <= set(choices) and len(set(got)) > 1, got
    for t in texts(StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/')):
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", t), t
    for t in texts(StructuredOutputsParams(grammar='root ::= "x" [ab]{2} "!"')):  # GBNF
        assert re.fullmatch(r"x[ab]{2}!", t), t
    obj = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"], "additionalProperties": False}
    for t in texts(StructuredOutputsParams(json=obj)):
        assert isinstance(json.loads(t)["k"], bool)


def test_an_empty_json_schema_is_a_constraint_not_a_crash(llm):
    """`{"json": {}}` (any JSON) was counted as given by the validation but not by `kind`: StopIteration, a 500
    (found by the schemathesis fuzzer)."""
    so = StructuredOutputsParams(json={})
    assert so.kind == "json" and so.cache_key() == '["json",{},false]'
    out = llm.generate(PROMPTS[:1], constrained(so, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("stop", "length")


def test_compile_cache_and_errors(llm):
    mgr = llm.engine.structured
    before = mgr.stats.compiles
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}
    reordered = {"required": ["q"], "properties": {"q": {"type": "integer"}}, "type": "object"}
    for s in (schema, reordered):
        llm.generate(PROMPTS[:1], constrained(StructuredOutputsParams(json=s), max_tokens=8), use_tqdm=False)
    assert mgr.stats.compiles == before + 1
    with pytest.raises(ValueError, match="Invalid regex constraint"):
        llm.engine.add_request("bad-re", "x", constrained(StructuredOutputsParams(regex="a(b")))
    with pytest.raises(ValueError, match="Invalid json constraint"):
        llm.engine.add_request("bad-js", "x", constrained(StructuredOutputsParams(json={"type": "frobnicate"})))
    with pytest.raises(ValueError, match="Invalid grammar constraint"):
        llm.engine.add_request("bad-g", "x", constrained(StructuredOutputsParams(grammar="start: undefined_rule")))
    for i, gbnf in enumerate(("root ::= (", 'root ::= "a" rest')):  # the converter's own errors, an undefined rule
        with pytest.raises(ValueError, match="Invalid grammar constraint: GBNF"):
            llm.engine.add_request(f"bad-gbnf-{i}", "x", constrained(StructuredOutputsParams(grammar=gbnf)))
    assert not llm.engine.has_unfinished_requests()


def test_replay_reproduces_the_matcher_state(llm):
    mgr = llm.engine.structured
    so = StructuredOutputsParams(json=SCHEMA)
    tokens = llm.engine.tokenizer.encode('{"name":"ab","age":3', add_special_tokens=False)
    live = mgr.new_matcher(so)
    for t in tokens:
        assert live.consume_token(t)
    assert torch.equal(mgr.fill_bitmask([live]), mgr.fill_bitmask([mgr.replay(mgr.compile(so), tokens)]))


def test_grammars_beyond_the_cache_are_never_compiled_on_the_engine_thread(tiny_model_dir):
    """More distinct grammars than the compile cache holds: each request keeps the constraint compiled before it
    was queued (its params), so admitting it, running it and replaying it after preemption compile nothing."""
    from pagedlm.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=12, block_size=4,
                                 preemption_mode="recompute")
    mgr = engine.structured
    mgr.cache_size = 2
    params = [constrained(StructuredOutputsParams(regex=f"[a-z]{{{i + 2},40}}"), max_tokens=30, ignore_eos=True)
              for i in range(4)]
    for p in params:  # what the server does on its grammar stage
        engine.input_processor.prepare_params(p)
    compiled = mgr.stats.compiles
    assert compiled == 4 and len(mgr._cache) == 2
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], p)
    outs = Steps(engine).run()
    assert mgr.stats.compiles == compiled and engine.get_stats().num_preemptions > 0
    for i, p in enumerate(params):
        assert re.fullmatch(p.structured_outputs.regex, outs[f"r{i}"].outputs[0].text)


def test_an_ambiguous_grammar_stops_at_the_parser_limits(llm):
    """An ambiguous grammar whose parse grows with every token (Earley items): under llguidance's default limits
    its 150 tokens cost 17 s of masks (over 100 ms a step at the end, on this 512-token vocabulary), every step
    of the batch waiting; with the limits set in structured.py its request fails near token 60, naming the limit,
    and a request beside it is unaffected."""
    engine = llm.engine
    abc = [engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in "abc"]
    so = StructuredOutputsParams(grammar='start: s\ns: s s | s s s | s s s s | "a" | "b" | "c" | "ab" | "bc"')
    engine.add_request("ambiguous", PROMPTS[0], SamplingParams(max_tokens=150, ignore_eos=True, seed=0,
                                                               allowed_token_ids=abc, structured_outputs=so))
    engine.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    outs = Steps(engine).run()
    bad, plain = outs["ambiguous"], outs["plain"]
    assert bad.error is not None and "max is 500" in str(bad.error), bad.error
    assert 20 < len(bad.outputs[0].token_ids) < 150
    want = llm.generate(PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0), use_tqdm=False)
    assert plain.error is None and plain.outputs[0].token_ids == want[0].outputs[0].token_ids


def _greedy(path, prompts, so_list, **kw):
    llm = LLM(str(path), dtype="float32", **kw)
    params = [constrained(so, max_tokens=60) for so in so_list]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


CONSTRAINTS = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[a-z]{4,9}( [a-z]{2,5}){3}"),
               StructuredOutputsParams(json_object=True), StructuredOutputsParams(choice=["alpha", "beta"])]


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    return [_greedy(tiny_model_dir, [p], [so], num_kv_blocks=256)[0][0] for p, so in zip(PROMPTS, CONSTRAINTS)]


@pytest.mark.parametrize("kw", [
    dict(num_kv_blocks=256),
    dict(num_kv_blocks=256, max_num_batched_tokens=5),
    dict(num_kv_blocks=20, block_size=4, preemption_mode="recompute"),
    dict(num_kv_blocks=20, block_size=4, preemption_mode="swap", swap_space=2**20),
], ids=["batched", "chunked", "recompute", "swap"])
def test_greedy_constrained_same_alone_batched_and_preempted(tiny_model_dir, alone, kw):
    got, llm = _greedy(tiny_model_dir, PROMPTS, CONSTRAINTS, **kw)
    assert got == alone
    if "preemption_mode" in kw:
        assert llm.engine.get_stats().num_preemptions > 0, "the test must force preemption"


def test_forks_keep_their_own_grammar_state(llm):
    """n=2 seeded samples (matchers forked from the prompt's) equal two requests with seeds s, s+1."""
    so = StructuredOutputsParams(json=SCHEMA)
    forked = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=256, n=2, seed=40,
                                                      structured_outputs=so), use_tqdm=False)[0]
    single = [llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=256, seed=40 + i,
                                                       structured_outputs=so), use_tqdm=False)[0].outputs[0]
              for i in range(2)]
    assert [o.token_ids for o in forked.outputs] == [o.token_ids for o in single]
    for o in forked.outputs:
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_greedy_grammar_rows_pick_the_best_allowed_token():
    torch.manual_seed(1)
    logits = torch.randn(3, 70)
    order = logits.argsort(-1, descending=True)
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    want = []
    for i, t in enumerate([int(order[0, 0]), int(order[1, 3]), int(order[2, 1])]):  # row 0: the argmax allowed
        for u in (t, int(order[i, 5])):
            bitmask[i, u // 32] |= 1 << (u % 32)
        want.append(t)
    p = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a"))
    rows = [SamplingRow(p, [1], [], bitmask=bitmask[i]) for i in range(3)]
    assert Sampler()(logits, rows).token_ids == want
    assert Sampler()(logits[1:2], rows[1:2]).token_ids == want[1:2]
