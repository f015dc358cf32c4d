"""The fused decoder stack (model/llama_decode.py) against the layer-by-layer torch path it replaces."""
from __future__ import annotations

import math

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.model import quant
from pagedlm.model.llama_decode import LlamaDecodeKernel, load_decode_kernel

pytestmark = pytest.mark.skipif(load_decode_kernel() is None, reason="fused decode kernel unavailable")

MAX_TOKENS = 16  # tokens per step in these runs (prefill chunks mixed with decode tokens)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


def _generate(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture
def count_runs(monkeypatch):
    """Counts the steps the fused kernel took (run returned True)."""
    taken = []
    original = LlamaDecodeKernel.run

    def run(self, x, *args):
        ok = original(self, x, *args)
        if ok:
            taken.append(x.shape[0])
        return ok

    monkeypatch.setattr(LlamaDecodeKernel, "run", run)
    return taken


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory):
    """The tiny Gemma 3 with a sliding window of 8 on 5 of its 6 layers: two KV cache groups, two RoPE tables."""
    from conftest import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_fused"), sliding_window=8,
                             max_position_embeddings=256)


@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, "auto"), ("int8", "auto"), ("int4", "auto"),
                                                         (None, "int8"), ("int4", "int8"), (None, "bfloat16"),
                                                         ("int4", "bfloat16"), (None, "float16"), ("int4", "float16"),
                                                         ("bf16", "auto")])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fused_decode_equals_torch_layers(family, tiny_model_dir, tiny_gemma_dir, quantization, kv_cache_dtype,
                                          count_runs):
    """Greedy tokens are identical (up to a near-tie, where one sequence at most may part) and logprobs agree to
    float32 rounding (a bf16 or fp16 cache: to the odd K/V entry that rounds the other way from a last-bit fp32
    difference, and so for Q8 activations). The fused run's steps hold
    up to 16 tokens (prefill chunks mixed with decode tokens), and so do the torch run's, so both multiply with the
    same quantized kernels. Gemma 3: QK-norm, sandwich norms, GELU, its two RoPE tables and the sliding-window
    layers' own KV cache group, past the window. "bf16": the default of an HF checkpoint on a CPU with AVX512-BF16
    (bf16 weights, fp32 activations rounded to bf16 at each product, as Q8 activations are)."""
    _check_fused_equals_torch(tiny_model_dir if family == "llama" else tiny_gemma_dir, family, quantization,
                              kv_cache_dtype, count_runs)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_fused_decode_adds_qwen2s_qkv_biases(tiny_qwen2_dir, quantization, count_runs):
    """Qwen2's q/k/v biases are added by the stack (a quantized projection's bias apart from it, `WithBias`), so its
    layers run fused too, with the torch layers' results."""
    _check_fused_equals_torch(tiny_qwen2_dir, "qwen2", quantization, "auto", count_runs)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    from test_families import build_family

    return build_family("qwen2", tmp_path_factory.mktemp("tiny_qwen2_fused"))


@pytest.mark.parametrize("quantization", [None, "int4"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "qwen2-moe", "olmoe"])
def test_fused_decode_routes_experts(family, quantization, tmp_path_factory, count_runs):
    """Mixture-of-experts layers run in the stack: the router's softmax and top k, each chosen expert's products
    over its tokens, weighted and summed in expert order, and Qwen2-MoE's shared expert behind its sigmoid gate, as
    model/moe.py does, with the torch layers' results; the expert counters count what the stack routed (Qwen2-MoE:
    its first layer is dense). OLMoE's QK-norms over the whole q / k projections and its q/k/v clamping too."""
    from test_families import build_family

    path = build_family(family, tmp_path_factory.mktemp(f"tiny_{family}_fused"))
    _check_fused_equals_torch(path, family, quantization, "auto", count_runs)


def _check_fused_equals_torch(path, family, quantization, kv_cache_dtype, count_runs):
    bf16 = quantization == "bf16"
    if bf16 and not quant.bf16_x16_native():
        pytest.skip("bf16 weights are the default only where the CPU has AVX512-BF16")
    # Q8 activations (int4, and the int8 x16 layout the LM head takes on AVX-512 VNNI) turn a last-bit difference
    # of the two paths' RMSNorm into the odd activation rounded to the other int8 step, as a bf16 cache does K/V.
    quantized_acts = quantization in ("int4", "bf16") or (quantization == "int8" and quant.x16_native(8))
    tol = 1e-2 if kv_cache_dtype in ("bfloat16", "float16") or quantized_acts else 1e-4
    if family == "gemma3" and quantized_acts:
        tol = 3e-2  # its random norms after every block amplify an activation rounded to the other Q8 step
    prompts = [[5 + i] * (3 + 4 * i) for i in range(5)]
    kw = dict(dtype="auto" if bf16 else "float32", num_kv_blocks=64, block_size=8,
              quantization=None if bf16 else quantization, kv_cache_dtype=kv_cache_dtype, kernel_max_rows=MAX_TOKENS)
    if family in ("mixtral", "qwen3-moe", "qwen2-moe", "olmoe"):
        kw["speculative_config"] = "off"  # no draft rows: the expert counters count the tokens below exactly
    fused_llm = LLM(str(path), max_num_batched_tokens=MAX_TOKENS, **kw)
    assert (fused_llm.engine.plan.quantization == "bf16") == bf16
    fused = _generate(fused_llm, prompts)
    assert count_runs and max(count_runs) <= MAX_TOKENS and len(set(count_runs)) > 2
    if family == "qwen2":
        kernel = fused_llm.engine.runner.model.decode_kernel()
        assert all(layer.qkv_bias for layer in kernel._layers)
    if family == "qwen2-moe":
        model = fused_llm.engine.runner.model
        dense, moe = model.decode_kernel()._layers
        assert not dense.router and moe.router and moe.shared_down and moe.shared_gate
    if family == "olmoe":
        layers = fused_llm.engine.runner.model.decode_kernel()._layers
        assert all(layer.router and layer.qk_norm_whole and layer.clip_qkv == 1.0 for layer in layers)
    if family in ("mixtral", "qwen3-moe"):
        model = fused_llm.engine.runner.model
        assert all(layer.router and layer.num_experts == 8 for layer in model.decode_kernel()._layers)
        first, last = (int(layer.mlp.expert_tokens.sum()) for layer in model.layers)
        # every prompt and generated token but the last passes the first layer; the stack's last layer runs its MLP
        # only over the rows whose logits are read (a prompt's last token and each decoded one)
        k = model.cfg.num_experts_per_tok
        passed = sum(len(p) for p in prompts) + sum(len(f.token_ids) - 1 for f in fused)
        assert first == passed * k and sum(len(f.token_ids) for f in fused) * k <= last < first
    if family == "gemma3":
        runner = fused_llm.engine.runner
        kernel = runner.model.decode_kernel()
        assert len({layer.group for layer in kernel._layers}) == len(set(runner.layer_group)) > 1
        assert sorted({layer.rope for layer in kernel._layers}) == [0, 1]
    torch_llm = LLM(str(path), max_num_batched_tokens=MAX_TOKENS, **kw)  # the same linear kernels
    torch_llm.engine.runner.model._decode_kernel = None  # layer by layer
    count_runs.clear()
    plain = _generate(torch_llm, prompts)
    assert not count_runs
    diverged = 0
    for f, p in zip(fused, plain):
        n = _agreeing_prefix(f, p, tol)
        diverged += n < len(p.token_ids)
        if n == len(p.token_ids):
            assert f.cumulative_logprob == pytest.approx(p.cumulative_logprob, abs=tol)
        for lf, lp in zip(f.logprobs[:n], p.logprobs[:n]):
            for tok in set(lf) | set(lp):  # the runner-up may differ between near-ties, within tol
                if tok in lf and tok in lp:
                    assert lf[tok].logprob == pytest.approx(lp[tok].logprob, abs=tol)
                else:
                    other = lp if tok in lf else lf
                    shown = (lf if tok in lf else lp)[tok].logprob
                    assert shown <= min(t.logprob for t in other.values()) + tol
    # Every parting is at a near-tie (asserted above). Gemma 3's random norms with Q8 activations make them common:
    # on a Sapphire Rapids (torch's AVX512-FP16 builds of the elementwise ops) two of the five prompts meet one.
    assert diverged <= (2 if family == "gemma3" and quantized_acts else 1), "more sequences met a near-tie"


def test_fused_decode_runs_gguf_blocks_as_the_torch_layers(tiny_model_dir, tmp_path, count_runs):
    """The default plan on a GGUF mixing kinds (Q4_0 / Q4_1 int4 layers, Q5_0 gate/up, a q/k/v of Q4_0 q/k beside a
    Q8_0 v run part by part): the fused stack takes its steps with those layers and gives the torch layers' tokens
    and logprobs (the same kernels per layer; only the stack's own sums differ in order, before Q8 activations)."""
    from test_quantization import _tiny_gguf

    types = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q5_0",
             "up_proj": "Q5_0", "down_proj": "Q4_1"}
    path = _tiny_gguf(tiny_model_dir, tmp_path / "tiny-mixed.gguf", types)
    kw = dict(num_kv_blocks=64, block_size=8, max_num_batched_tokens=MAX_TOKENS, kernel_max_rows=MAX_TOKENS)
    fused_llm = LLM(str(path), **kw)
    layer = fused_llm.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, quant.ConcatLinear) and isinstance(layer.mlp.gate_up_proj,
                                                                                     quant.GGUFLinear)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(5)]
    fused = _generate(fused_llm, prompts)
    assert count_runs and len(set(count_runs)) > 2
    torch_llm = LLM(str(path), **kw)
    torch_llm.engine.runner.model._decode_kernel = None  # layer by layer
    count_runs.clear()
    plain = _generate(torch_llm, prompts)
    assert not count_runs
    tol, diverged = 1e-2, 0  # Q8 activations turn a last-bit difference into the odd other int8 step
    for f, p in zip(fused, plain):
        n = _agreeing_prefix(f, p, tol)
        diverged += n < len(p.token_ids)
        for lf, lp in zip(f.logprobs[:n], p.logprobs[:n]):
            for tok in set(lf) & set(lp):
                assert lf[tok].logprob == pytest.approx(lp[tok].logprob, abs=tol)
    assert diverged <= 1


def _agreeing_prefix(f, p, tol: float) -> int:
    """How many greedy tokens the two runs share. They may part only at a near-tie: where both runs' top two
    tokens are within `tol` of each other (a last-bit difference of the two paths' sums picks either), after which
    the sequences are different texts."""
    for i, (a, b) in enumerate(zip(f.token_ids, p.token_ids)):
        if a != b:
            for lps in (f.logprobs[i], p.logprobs[i]):
                assert a in lps and b in lps and abs(lps[a].logprob - lps[b].logprob) <= tol, (i, a, b)
            return i
    assert len(f.token_ids) == len(p.token_ids)
    return len(p.token_ids)


def test_fused_decode_forward_matches_on_mixed_batch(tiny_model_dir, count_runs):
    """One forward pass over a mixed batch (a 4-token prefill chunk after cached context plus decode tokens of
    other sequences) gives the same logits through the kernel (which must have taken all 6 tokens) as through the
    torch layers, and writes the same K/V into the cache."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    eng = llm.engine
    runner, model = eng.runner, eng.runner.model
    from pagedlm.engine.model_runner import Chunk

    torch.manual_seed(0)
    chunks = [Chunk(token_ids=[7, 8, 9, 10], start=9, block_tables=[[3, 11]]),
              Chunk(token_ids=[20], start=30, block_tables=[[5, 1, 40, 2]]),
              Chunk(token_ids=[21], start=0, block_tables=[[17]])]
    caches = runner.kv_cache
    for t in caches.layer_caches():
        for c in t:
            c.normal_()
    before = [tuple(c.clone() for c in kv) for kv in caches.layer_caches()]
    fused = runner.execute(chunks, [3, 4, 5])
    assert count_runs == [6]
    after_fused = [tuple(c.clone() for c in kv) for kv in caches.layer_caches()]
    for kv, saved in zip(caches.layer_caches(), before):
        for c, s in zip(kv, saved):
            c.copy_(s)
    model._decode_kernel = None
    plain = runner.execute(chunks, [3, 4, 5])
    assert count_runs == [6]
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    for kf, kp in zip(after_fused, caches.layer_caches()):
        for a, b in zip(kf, kp):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fp16_cache_saturates_in_the_fused_stack_as_in_torch(tiny_model_dir, count_runs):
    """K/V beyond fp16's range are stored as +-65504, its largest finite value, not as infinities (which would
    turn attention into NaN), by the fused stack's writer and by the torch path's (kvcache/quant.py `to_cache`)
    alike: with the k and v projections scaled up so that many entries overflow, both runs keep saturated caches
    and give the same finite tokens and logprobs."""
    from pagedlm.kvcache.quant import FP16_MAX

    prompts = [[5 + i] * (3 + 4 * i) for i in range(3)]
    kw = dict(dtype="float32", num_kv_blocks=64, block_size=8, kv_cache_dtype="float16", kernel_max_rows=MAX_TOKENS,
              max_num_batched_tokens=MAX_TOKENS, enable_prefix_caching=False)
    runs = []
    for fused in (True, False):
        llm = LLM(str(tiny_model_dir), **kw)
        model = llm.engine.runner.model
        if not fused:
            model._decode_kernel = None  # layer by layer
        for layer in model.layers:
            attn = layer.self_attn
            w = attn.qkv_proj.weight.data
            (w[:, attn.q_size:] if attn.qkv_proj.transposed else w[attn.q_size:]).mul_(3e5)  # k and v
        count_runs.clear()
        runs.append(_generate(llm, prompts))
        assert bool(count_runs) == fused
        caches = [c for kv in llm.engine.runner.layer_caches for c in kv]
        assert all(c.dtype == torch.float16 and torch.isfinite(c).all() for c in caches)
        assert max(c.abs().max().item() for c in caches) == FP16_MAX
    for f, p in zip(*runs):
        assert f.token_ids == p.token_ids
        for lf, lp in zip(f.logprobs, p.logprobs):
            for tok in set(lf) & set(lp):
                assert math.isfinite(lf[tok].logprob)
                assert lf[tok].logprob == pytest.approx(lp[tok].logprob, abs=1e-2)


def test_fused_decode_steps_aside(tiny_model_dir, count_runs):
    """The kernel is not used where it would not give the torch path's results: another attention backend,
    bf16 activations, an fp8 KV cache."""
    prompt = [[5, 6, 7]]
    for kw in (dict(attention_backend="reference"), dict(dtype="bfloat16"), dict(kv_cache_dtype="fp8_e4m3")):
        llm = LLM(str(tiny_model_dir), num_kv_blocks=32, **{"dtype": "float32", **kw})
        _generate(llm, prompt)
        assert not count_runs, kw


def test_backend_without_fused_decode_runs_the_torch_layers(tiny_model_dir, count_runs):
    """The model asks the backend: the CPU kernel's lets the fused stack run the batch (no torch layer runs), the
    reference backend does not (the fused stack is not even built, every torch layer runs), and both give the
    same logits."""
    from pagedlm.attention import get_attention_backend
    from pagedlm.engine.model_runner import Chunk

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    runner, model = llm.engine.runner, llm.engine.runner.model
    reference = get_attention_backend("reference")
    assert runner.attn_backend.supports_fused_decode and not reference.supports_fused_decode
    layers_run = []
    for layer in model.layers:
        layer.register_forward_hook(lambda *_: layers_run.append(1))
    torch.manual_seed(0)
    for kv in runner.layer_caches:
        for c in kv:
            c.normal_()
    saved = [tuple(c.clone() for c in kv) for kv in runner.layer_caches]
    chunks = [Chunk(token_ids=[7, 8, 9, 10], start=9, block_tables=[[3, 11]]),
              Chunk(token_ids=[20], start=30, block_tables=[[5, 1, 40, 2]])]
    fused = runner.execute(chunks, [3, 4])
    assert count_runs == [5] and not layers_run
    for kv, before in zip(runner.layer_caches, saved):
        for c, b in zip(kv, before):
            c.copy_(b)
    model._decode_kernel = False  # built again on demand: the reference backend must not ask for it
    runner.attn_backend = reference
    plain = runner.execute(chunks, [3, 4])
    assert count_runs == [5] and model._decode_kernel is False and len(layers_run) == len(model.layers)
    torch.testing.assert_close(plain, fused, atol=1e-4, rtol=1e-4)


def _mixed_batch(tiny_model_dir, kv_cache_dtype="auto"):
    """A runner with random caches, a mixed batch's tensors and its chunks (as in the test above)."""
    from pagedlm.engine.model_runner import Chunk

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=8, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    torch.manual_seed(0)
    for kv in runner.kv_cache.layer_caches():
        for c in kv:
            c.copy_(torch.randint(-100, 100, c.shape).to(c.dtype))
    chunks = [Chunk(token_ids=[7, 8, 9, 10], start=9, block_tables=[[3, 11]]),
              Chunk(token_ids=[20], start=30, block_tables=[[5, 1, 40, 2]]),
              Chunk(token_ids=[21], start=0, block_tables=[[17]])]
    return runner, chunks


@pytest.mark.parametrize("bad", ["block_past_end", "block_negative", "slot_past_end", "slot_negative"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_fused_decode_rejects_ids_outside_the_cache(tiny_model_dir, bad, kv_cache_dtype):
    """A block id the stack would read or a slot it would write outside the cache: ValueError from the kernel's
    up-front check, and no layer's cache (nor the hidden states) changed."""
    runner, chunks = _mixed_batch(tiny_model_dir, kv_cache_dtype)
    model, caches = runner.model, runner.layer_caches
    kernel = model.decode_kernel()
    assert kernel is not None
    input_ids, positions, metas = runner.prepare(chunks)
    num_blocks = caches[0][0].shape[0]
    meta = metas[0]
    if bad.startswith("block"):
        meta.block_tables[1, 2] = num_blocks if bad == "block_past_end" else -1
    else:
        meta.slot_mapping[2] = num_blocks * 8 if bad == "slot_past_end" else -1
    x = model.embed_tokens(input_ids).contiguous()
    rope = model.rotary.cos_sin(positions, x.dtype)
    saved = [tuple(c.clone() for c in kv) for kv in caches], x.clone()
    with pytest.raises(ValueError, match=f"fused decode kernel \\({num_blocks} KV blocks\\): a "
                                         f"{'block table' if bad.startswith('block') else 'slot mapping'} entry"):
        kernel.run(x, *rope, caches, [meta] * len(caches))
    assert torch.equal(x, saved[1])
    for kv, before in zip(caches, saved[0]):
        assert all(torch.equal(c, b) for c, b in zip(kv, before))


@pytest.mark.parametrize("bad", ["uncovered", "freed"])
def test_prepare_refuses_a_new_token_outside_its_blocks(tiny_model_dir, bad):
    """A new token whose position its block table does not cover (the zero padding would send it to block 0 of
    another sequence) or whose block was freed: a RuntimeError (also under `python -O`), nothing written."""
    from pagedlm.kvcache.block_manager import NULL_BLOCK

    runner, chunks = _mixed_batch(tiny_model_dir)
    if bad == "uncovered":
        chunks[0].block_tables = [[3]]  # tokens 9..12 need blocks 0 and 1
        match = "past the end of its block table"
    else:
        chunks[1].block_tables = [[5, 1, 40, NULL_BLOCK]]  # token 30 is in block 3
        match = "in a freed block"
    saved = [tuple(c.clone() for c in kv) for kv in runner.layer_caches]
    with pytest.raises(RuntimeError, match=match):
        runner.execute(chunks, [0])
    for kv, before in zip(runner.layer_caches, saved):
        assert all(torch.equal(c, b) for c, b in zip(kv, before))


def test_fp32_weights_take_the_stack_for_small_steps_only(tiny_model_dir, count_runs):
    """Over fp32 weights the stack runs steps of up to F32_MAX_TOKENS tokens; a longer prefill chunk runs the torch
    layers (whose sgemm is faster there), the decode steps after it the stack."""
    from pagedlm.model.llama_decode import F32_MAX_TOKENS

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    out = _generate(llm, [[5, 6, 7] * 40])
    assert len(out[0].token_ids) == PARAMS.max_tokens
    assert count_runs and max(count_runs) <= F32_MAX_TOKENS < 120
    assert llm.engine.runner.model.decode_kernel().max_tokens == F32_MAX_TOKENS
