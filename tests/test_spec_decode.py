"""Speculative decoding (docs/speculative.md): drafts verified in the batched step, lossless for greedy and sampled
requests, the rejected tail's KV slots returned, predicted outputs accounted, bad configuration refused."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.config import EngineConfig, SpeculativeConfig
from pagedlm.config.speculative import DEFAULT as DEFAULT_SPECULATION
from pagedlm.kvcache.block_manager import BlockManager

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


# --- greedy identity ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in (REPEAT, "Hello! How are you today?", "Once upon a time, there was " * 4)]
    return prompts, run(llm, prompts, greedy(n=1)), run(llm, prompts, greedy(n=3, max_tokens=16))


@pytest.mark.parametrize("kw", [
    dict(num_kv_blocks=256), dict(num_kv_blocks=256, max_num_batched_tokens=7),
    dict(num_kv_blocks=256, enable_prefix_caching=False),
    dict(num_kv_blocks=64, preemption_mode="recompute", max_num_batched_tokens=64),
    dict(num_kv_blocks=64, preemption_mode="swap", swap_space=2**20, max_num_batched_tokens=64),
], ids=["default", "chunked-prefill", "no-prefix-cache", "preempt-recompute", "preempt-swap"])
def test_greedy_identical_with_ngram_tiny(tiny_model_dir, tiny_reference, kw):
    prompts, expected, expected_n3 = tiny_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=4, speculative_config=NGRAM, **kw)
    assert run(llm, prompts, greedy()) == expected
    assert run(llm, prompts, greedy(n=3, max_tokens=16)) == expected_n3
    st = spec_stats(llm)
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st
    if "preemption_mode" in kw:
        assert llm.engine.scheduler.num_preemptions > 0, "the test must force preemption"


def test_greedy_requests_draft_by_default(tiny_model_dir, tiny_reference, caplog):
    """With no speculative_config, greedy requests draft by prompt lookup (and give the same tokens); sampled ones do
    not (a seeded request's tokens stay independent of the requests beside it); `off` drafts for none. The start-up
    log says which."""
    prompts, expected, _ = tiny_reference
    with caplog.at_level("INFO", logger="pagedlm.engine.llm_engine"):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    assert "speculative decoding: prompt lookup for greedy requests" in caplog.text
    assert llm.engine.spec.config == DEFAULT_SPECULATION and not DEFAULT_SPECULATION.sampled
    assert run(llm, prompts, greedy()) == expected
    drafted = spec_stats(llm).num_draft_tokens
    assert drafted > 0
    run(llm, prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True))
    assert spec_stats(llm).num_draft_tokens == drafted
    off = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    assert off.engine.spec.config is None
    assert run(off, prompts, greedy()) == expected and spec_stats(off).num_draft_tokens == 0


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory):
    from conftest import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_spec"), sliding_window=8,
                             max_position_embeddings=256)


def test_greedy_identical_sliding_window(tiny_gemma_dir):
    """Gemma 3 (two KV cache groups, sliding-window blocks freed as they leave the window) with drafts."""
    base = LLM(str(tiny_gemma_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    prompts = [base.get_tokenizer().encode(REPEAT), base.get_tokenizer().encode("Once upon a time, there was " * 3)]
    expected = run(base, prompts, greedy(max_tokens=32))
    spec = LLM(str(tiny_gemma_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config=NGRAM)
    assert run(spec, prompts, greedy(max_tokens=32)) == expected
    exact = run(spec, prompts[:1], greedy(max_tokens=32, prediction=expected[0][0]))
    assert exact == expected[:1]
    assert spec_stats(spec).num_accepted_tokens > 10


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


def test_greedy_identical_smollm2(smollm2_path):
    """A real model copies a quoted passage: n-gram drafts are accepted, and the output is the same as without."""
    prompt = ("Repeat the following sentence exactly.\nSentence: The paged key value cache stores attention keys "
              "and values in fixed size blocks, so that memory can be shared.\nRepeated: The paged")
    base = LLM(str(smollm2_path), num_kv_blocks=128, max_num_batched_tokens=32, speculative_config="off")
    spec = LLM(str(smollm2_path), num_kv_blocks=128, max_num_batched_tokens=32,
               speculative_config={**NGRAM, "num_speculative_tokens": 6})
    params = greedy(max_tokens=32, n=2)
    assert run(spec, [prompt], params) == run(base, [prompt], params)
    st = spec_stats(spec)
    assert st.num_accepted_tokens >= 10, st


def dense_products(llm) -> list[int]:
    """The rows of every product `llm`'s quantized layers run as a GEMM from now on (each dense copy dropped, so
    each GEMM goes through `per_call_product`)."""
    from pagedlm.model.quant import QuantLinear

    seen = []
    for m in llm.engine.runner.model.modules():
        if isinstance(m, QuantLinear) and m.dense is not None:
            m.set_dense(torch.bfloat16 if m.dense_packed else m.dense.dtype, copy=False)
        if isinstance(m, QuantLinear):
            product = m.per_call_product
            m.per_call_product = lambda x, product=product: seen.append(x.shape[0]) or product(x)
    return seen


def test_greedy_identical_under_the_quantized_plan(smollm2_path):
    """The default plan on the real checkpoint (its own Q4_1/Q8_0 blocks), with the quantized kernels for steps of at
    most 4 rows and a GEMM above (which rounds differently): a code edit drafted from its prediction (up to 16 draft
    rows a step, past 256 keys where attention splits its key range) gives the tokens decoding one at a time gives.
    Its verify steps do not move to the GEMM (model/step_rows.py), and attention rows do not depend on the rows
    beside them (test_attention.py); either broken, these tokens differ."""
    from pagedlm.bench.speculative import WORKLOADS, prompts

    edit = next(w for w in WORKLOADS if w.prediction)
    kw = dict(num_kv_blocks=128, enable_prefix_caching=False, kernel_max_rows=4, speculative_config="off")
    base = LLM(str(smollm2_path), **kw)
    assert base.engine.plan.quantization and base.engine.plan.kernel_max_rows == 4
    [ids] = prompts(edit, 1, base.get_tokenizer())
    base_gemms = dense_products(base)
    expected = run(base, [ids], greedy(max_tokens=128))
    spec = LLM(str(smollm2_path), **kw)
    spec_gemms = dense_products(spec)
    assert run(spec, [ids], greedy(max_tokens=128, prediction=edit.prediction)) == expected
    st = spec_stats(spec)
    assert st.num_accepted_tokens >= 10 and st.num_accepted_tokens < st.num_draft_tokens, st
    assert len(ids) + 128 > 256
    assert base_gemms and sorted(spec_gemms) == sorted(base_gemms), "verify steps took the GEMM (only prefill does)"


# --- sampled requests keep the target distribution ------------------------------------------------------------
def test_rejection_sampling_keeps_the_distribution(tiny_model_dir):
    """Tokens 2-3 of a sampled request over four allowed tokens, with drafts from a prediction (so every request
    verifies drafts) and without: a chi-square test over 1000 samples each cannot tell them apart, while the
    drafts' own distribution is told apart (the test has the power to see a biased acceptance)."""
    from scipy.stats import chi2_contingency

    allowed = [40, 41, 42, 43]
    prompt = [5, 6, 7, 8, 9]
    n_req = 1000
    prediction = [42, 43, 40, 41, 42, 43, 40, 41]
    cfg = dict(dtype="float32", num_kv_blocks=2048, max_num_seqs=256, seed=1234)
    histograms = []
    for spec in (False, True):
        fixed = {**NGRAM, "num_speculative_tokens": 2, "adaptive": False, "disable_by_batch_size": 4096}
        llm = LLM(str(tiny_model_dir), **cfg, speculative_config=fixed if spec else None)
        params = SamplingParams(temperature=0.7, max_tokens=4, allowed_token_ids=allowed, ignore_eos=True,
                                prediction=prediction if spec else None)
        outs = llm.generate([prompt] * n_req, params, use_tqdm=False)
        histograms.append(Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs))
        if spec:
            st = spec_stats(llm)
            assert st.num_drafts >= n_req and 0 < st.num_accepted_tokens < st.num_draft_tokens, st
    cells = sorted(set(histograms[0]) | set(histograms[1]))
    table = [[h.get(c, 0) + 0.5 for c in cells] for h in histograms]
    assert chi2_contingency(table)[1] > 0.001, histograms
    # power: an "accept every draft" sampler would put all mass on the prediction's pairs
    drafted = Counter(tuple(prediction[i:i + 2]) for i in range(4) for _ in range(n_req // 4))
    assert chi2_contingency([[histograms[0].get(c, 0) + 0.5 for c in cells],
                             [drafted.get(c, 0) + 0.5 for c in cells]])[1] < 1e-6


# --- the block manager's rollback -----------------------------------------------------------------------------
class BlockSeq:
    ids = iter(range(10**6))

    def __init__(self, tokens, cache_salt=None):
        self.seq_id, self.tokens, self.num_computed_tokens, self.cache_salt = next(self.ids), list(tokens), 0, None

    @property
    def num_tokens(self):
        return len(self.tokens)

    def token_slice(self, start, end):
        return self.tokens[start:end]


def check_invariants(bm: BlockManager, seqs):
    refs = Counter(b for s in seqs for t in bm.block_tables.get(s.seq_id, []) for b in t if b >= 0)
    for block in range(bm.gpu.num_blocks):
        assert bm.gpu.ref_counts[block] == refs.get(block, 0), block
        assert (block in bm.gpu.free_blocks) == (refs.get(block, 0) == 0), block
    for s in seqs:
        table = bm.get_block_table(s)
        assert len(table) == -(-s.num_computed_tokens // bm.block_size), "the tail past the computed tokens stays"
        for i, block in enumerate(table):  # a cached block holds the sequence's own accepted tokens
            h = bm.gpu.block_hash[block]
            if h is not None:
                assert (i + 1) * bm.block_size <= s.num_computed_tokens
                assert bm.gpu.block_tokens[block] == s.token_slice(i * bm.block_size, (i + 1) * bm.block_size)


@pytest.mark.parametrize("seed", range(6))
def test_truncate_rollback_keeps_invariants(seed):
    """Speculative steps with random draft and accept lengths, forks and frees, with prefix caching: ref counts
    match the tables, rejected slots return to the pool, only accepted tokens are ever cached, nothing leaks."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=400, block_size=4, enable_prefix_caching=True)
    live: list[BlockSeq] = []
    for _ in range(120):
        op = rng.random()
        if op < 0.15 or not live:
            s = BlockSeq([rng.randrange(6) for _ in range(rng.randrange(2, 15))])
            hit = bm.find_cached_prefix(s)
            s.num_computed_tokens = len(hit) * bm.block_size
            bm.allocate(s, s.num_tokens - s.num_computed_tokens, hit)
            bm.commit(s, s.num_tokens)
            s.num_computed_tokens = s.num_tokens
            s.tokens.append(rng.randrange(6))  # the token sampled after the prompt
            live.append(s)
        elif op < 0.25:
            parent = rng.choice(live)
            child = BlockSeq(parent.tokens)
            child.num_computed_tokens = parent.num_computed_tokens
            bm.fork(parent, child)
            live.append(child)
        elif op < 0.32:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        else:  # one speculative step: the last token and k drafts, of which `a` are accepted
            s = rng.choice(live)
            k = rng.randrange(0, 7)
            bm.append_slots(s, 1 + k)
            bm.commit(s, s.num_tokens)
            a = rng.randrange(0, k + 1)
            s.tokens += [rng.randrange(6) for _ in range(a + 1)]  # accepted drafts and the token after them
            s.num_computed_tokens += 1 + a
            bm.truncate(s, s.num_computed_tokens)
        check_invariants(bm, live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_total_blocks


# --- configuration --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs model"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "not supported yet"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size must be 1"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "quantization": "q3"}, "quantization"),
    ({"method": "ngram", "model": "m", "num_speculative_tokens": 3}, "only for method 'draft_model'"),
    ({"method": "eagle9", "num_speculative_tokens": 3}, "method must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tokens": 2}, "unknown keys ['draft_tokens']"),
    ([1, 2], "JSON object"),
])
def test_bad_speculative_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=None) as e:
        EngineConfig(speculative_config=bad)
    assert message in str(e.value)


def test_speculative_config_flag():
    import argparse

    from pagedlm.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig, only=["speculative_config"])
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert parser.parse_args([]).speculative_config in ("auto", DEFAULT_SPECULATION)
    assert parser.parse_args(["--speculative-config", "off"]).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram"}'])


def test_prediction_is_checked():
    with pytest.raises(ValueError, match="prediction"):
        SamplingParams(prediction=[1, -2])
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(prediction="x", use_beam_search=True, max_tokens=4)


# --- predicted outputs on the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from server_utils import InProcessServer

    from pagedlm.config import LoopConfig
    from pagedlm.engine.async_engine import AsyncLLMEngine
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.server.api import build_app

    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=256),
                            LoopConfig.offline(log_interval=0))
    srv = InProcessServer(build_app({"tiny": engine}))
    yield srv
    srv.stop()
    engine.shutdown()


def test_prediction_usage_on_the_server(server):
    body = {"model": "tiny", "prompt": "Once upon a time, there was", "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    plain = server.post("/v1/completions", json=body).json()
    assert "completion_tokens_details" not in plain["usage"]
    text = plain["choices"][0]["text"]
    tok = server.post("/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}).json()
    n_pred = tok["count"]
    # the answer itself as the prediction: the same answer, and most of the prediction accepted
    got = server.post("/v1/completions", json={**body, "prediction": {"type": "content", "content": text}}).json()
    assert got["choices"][0]["text"] == text
    details = got["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == n_pred
    # chat, streamed, with a prediction that has nothing to do with the answer: all of it rejected
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    ref = server.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    other = "<|im_start|>" * 5
    lines = server.post("/v1/chat/completions", json={
        **chat, "stream": True, "stream_options": {"include_usage": True},
        "prediction": {"type": "content", "content": [{"type": "text", "text": other}]}}).text.splitlines()
    import json
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == ref
    usage = chunks[-1]["usage"]["completion_tokens_details"]
    assert usage["accepted_prediction_tokens"] == 0 and usage["rejected_prediction_tokens"] == 5
    metrics = server.metrics()
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] >= details["accepted_prediction_tokens"]
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0
    bad = server.post("/v1/completions", json={**body, "prediction": {"type": "text", "content": "x"}})
    assert bad.status_code == 400, bad.text


def test_logprobs_and_penalties_as_without_speculation(tiny_model_dir):
    """Every draft position is sampled with the request's own controls over the output so far (drafts included):
    penalties, bias and logprobs come out as without speculation."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config="off")
    prompt = llm.get_tokenizer().encode(REPEAT)
    params = dict(logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={7: 3.0}, min_tokens=5)
    ref = llm.generate(prompt, greedy(**params), use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompt, greedy(prediction=ref.token_ids, **params), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in got.logprobs] == \
        [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in ref.logprobs]
    assert spec_stats(llm).num_accepted_tokens >= len(ref.token_ids) // 2


# --- suffix drafts ---------------------------------------------------------------------------------------------
def test_suffix_method_greedy_identical_and_learns_from_earlier_requests(tiny_model_dir, tiny_reference):
    prompts, expected, _ = tiny_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4,
              speculative_config={**NGRAM, "method": "suffix", "prompt_lookup_min": 2})
    assert run(llm, prompts, greedy()) == expected
    before = spec_stats(llm).num_accepted_tokens
    assert run(llm, prompts[1:2], greedy()) == expected[1:2]  # its answer again: drafted from the cache
    assert spec_stats(llm).num_accepted_tokens - before >= len(expected[1][0]) // 2


def test_no_speculation_in_large_batches(tiny_model_dir, tiny_reference):
    """More running sequences than disable_by_batch_size: the step is not weight-bound, nobody drafts."""
    prompts, _, _ = tiny_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=4,
              speculative_config={**NGRAM, "disable_by_batch_size": 4})
    run(llm, prompts * 2, greedy())  # six sequences, side by side to the end
    assert spec_stats(llm).num_drafts == 0
    run(llm, prompts[:1], greedy())
    assert spec_stats(llm).num_drafts > 0


def test_replica_counters_sum():
    from pagedlm.engine.spec_decode import SpecStats

    total = SpecStats.total([SpecStats(1, 3, 2, [1, 1]), SpecStats(2, 4, 3, [2, 1, 0])])
    assert total == SpecStats(3, 7, 5, [3, 2, 0])
    assert total.mean_accepted_length == pytest.approx(1 + 5 / 3)
