"""Mixture-of-experts specifics (model/moe.py): grouping tokens by expert equals running them one at a time, also
with very unequal and zero tokens per expert; only the chosen experts run; quantized experts; the expert load
counters in the engine stats and in /metrics add up to tokens x top-k x MoE layers."""
from __future__ import annotations

import ctypes

import httpx
import pytest
import torch
from server_utils import InProcessServer
from test_families import build_family

from pagedlm import LLM, SamplingParams
from pagedlm.config import ModelConfig
from pagedlm.model.llama_decode import ExpertsKernel, load_decode_kernel
from pagedlm.model.moe import SparseMoE
from pagedlm.model.quant import GGUFLinear, Int4Linear, Int8Linear, WithBias
from pagedlm.model.quantize import quantize_model

HIDDEN, EXPERTS, TOP_K = 64, 8, 2


def skewed_moe(quantization: str | None = None, shared: int = 0) -> SparseMoE:
    """A random MoE layer whose router prefers expert 0, then 1, ...; experts 6 and 7 are never chosen for inputs
    with a positive component along `direction()`."""
    cfg = ModelConfig(model_type="qwen2_moe", vocab_size=16, hidden_size=HIDDEN, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, num_experts=EXPERTS,
                      num_experts_per_tok=TOP_K, moe_intermediate_size=64, shared_expert_intermediate_size=shared,
                      moe_layers=[True])
    torch.manual_seed(0)
    moe = SparseMoE(cfg)
    for p in moe.parameters():
        p.data.normal_(0, 0.1)
    u = direction()
    strength = torch.tensor([4.0, 3.0, 2.5, 2.0, 1.0, 0.5, -6.0, -6.0])
    moe.gate.weight.data = strength[:, None] * u[None] + 0.05 * torch.randn(EXPERTS, HIDDEN)
    if quantization:
        holder = torch.nn.Module()  # quantize_model works on a model: give it what it looks at
        holder.embed_tokens, holder.cfg, holder.moe = torch.nn.Embedding(16, HIDDEN), cfg, moe
        quantize_model(holder, quantization)
    return moe


def direction() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    u = torch.randn(HIDDEN, generator=g)
    return u / u.norm()


def tokens(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, HIDDEN, generator=g) + 2.0 * direction()


def count_kernel_experts(moe: SparseMoE) -> list[int]:
    """The experts the compiled experts kernel ran, one entry each (bound here, as the first one-token call would)."""
    ran: list[int] = []
    moe._kernel = ExpertsKernel.create(list(moe.experts), moe.hidden_act)
    if moe._kernel is not None:
        run = moe._kernel.run

        def counting(x, experts):
            out = run(x, experts)
            ran.extend(e for e, _ in experts if out is not None)
            return out
        moe._kernel.run = counting
    return ran


def count_expert_calls(moe: SparseMoE) -> list[int]:
    calls = [0] * EXPERTS
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: calls.__setitem__(e, calls[e] + 1))
    return calls


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_unequal_groups_equal_one_token_at_a_time(quantization):
    moe = skewed_moe(quantization, shared=32)
    if quantization:
        kind = Int8Linear if quantization == "int8" else Int4Linear
        assert all(isinstance(e.gate_up_proj, kind) and isinstance(e.down_proj, kind) for e in moe.experts)
    x = tokens(40)
    calls = count_expert_calls(moe)
    in_kernel = count_kernel_experts(moe)
    with torch.inference_mode():
        batched = moe(x)
        counts = moe.expert_tokens.tolist()
        assert counts[6] == counts[7] == 0 and counts[0] >= 30 and sum(counts) == 40 * TOP_K
        assert calls == [int(c > 0) for c in counts]  # one product per chosen expert, none for the others
        alone = []
        for i in range(x.shape[0]):
            before = sum(calls) + len(in_kernel)
            alone.append(moe(x[i:i + 1]))
            assert sum(calls) + len(in_kernel) - before == TOP_K  # a decoded token reads only its k experts
    # a decoded token's experts run in one call of the compiled experts kernel where it reads their layouts (the
    # quantized ones; fp32 experts stay with torch's products)
    assert (len(in_kernel) == 40 * TOP_K) == (quantization is not None and load_decode_kernel() is not None)
    torch.testing.assert_close(batched, torch.cat(alone), rtol=1e-5, atol=1e-5 if quantization != "int4" else 1e-4)
    assert moe.expert_tokens.sum().item() == 2 * 40 * TOP_K


def test_a_tokens_experts_give_the_same_bits_split_between_threads_or_by_rows():
    """One token's k experts (the compiled experts kernel, as the fused stack's decode runs them): with k a multiple
    of the threads each expert runs whole on one thread (one team pass for all), else each product's rows split
    between the threads; the bits are the same either way."""
    lib = load_decode_kernel()
    if lib is None:
        pytest.skip("no C++ compiler: the decode kernel is not built")
    split = lib.pagedlm_moe_split_tokens
    split.restype = ctypes.c_int64
    moe = skewed_moe("int4")
    x = tokens(1)
    threads = torch.get_num_threads()
    outs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            before = split()
            with torch.inference_mode():
                outs[n] = moe(x)
            assert split() - before == (n == 2)  # TOP_K = 2: split between 2 threads, by rows between 3
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[2], outs[3])


def test_router_matches_mixtral_softmax_over_selected_logits():
    moe = skewed_moe()
    moe.norm_topk_prob = True
    x = tokens(5)
    weights, ids = moe.route(x)
    logits = moe.gate(x)
    expected = torch.softmax(torch.gather(logits, 1, ids), dim=-1)
    torch.testing.assert_close(weights, expected)
    assert ids[:, 0].tolist() == [0] * 5


@pytest.fixture(scope="module")
def tiny_moe_dirs(tmp_path_factory):
    return {name: build_family(name, tmp_path_factory.mktemp(name)) for name in ("qwen2-moe", "mixtral")}


def _fake_quantized(path, method: str) -> LLM:
    """The fp32 engine with every Linear weight (and the embedding table, int8 per row) replaced by its quantized
    then dequantized value: what the quantized engine multiplies, computed by the plain fp32 path."""
    from pagedlm.model.layers import Linear
    from pagedlm.model.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

    def roundtrip(w: torch.Tensor, how: str) -> torch.Tensor:
        return dequantize_int8(*quantize_int8(w)) if how == "int8" else dequantize_int4(*quantize_int4(w, 32), 32)

    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    model = llm.engine.runner.model
    model.embed_tokens.weight.data = roundtrip(model.embed_tokens.weight.data, "int8")
    for m in model.modules():
        if isinstance(m, Linear):
            w = m.weight.data.t() if m.transposed else m.weight.data
            w = roundtrip(w, method)
            m.weight.data = w.t().contiguous() if m.transposed else w
    return llm


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_moe_with_biases(tiny_moe_dirs, quantization):
    """Qwen2-MoE (q/k/v biases, a dense layer, a shared expert) quantized: every Linear replaced, experts included,
    biases kept. Prompt logprobs equal those of the fp32 model over the same dequantized weights (int4, and int8 in
    the x16 layout of AVX-512 VNNI CPUs, also round activations to Q8 blocks, hence the looser bound); int8 greedy
    tokens are identical where its activations are not rounded."""
    path = tiny_moe_dirs["qwen2-moe"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, quantization=quantization)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, WithBias) and torch.count_nonzero(qkv.bias) == qkv.bias.numel()
    kind = Int8Linear if quantization == "int8" else Int4Linear
    assert all(isinstance(e.down_proj, kind) for e in model.layers[1].mlp.experts)
    ref = _fake_quantized(path, quantization)
    prompts = [[5, 9, 30, 41, 17], list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    outs, refs = llm.generate(prompts, params, use_tqdm=False), ref.generate(prompts, params, use_tqdm=False)
    from pagedlm.model.quant import x16_native

    exact = quantization == "int8" and not x16_native(8)  # int8's x16 layout rounds activations to Q8 too
    tol = 1e-3 if exact else 0.03
    for ours, theirs, prompt in zip(outs, refs, prompts):
        for pos in range(1, len(prompt)):
            tid = prompt[pos]
            assert abs(ours.prompt_logprobs[pos][tid].logprob - theirs.prompt_logprobs[pos][tid].logprob) < tol
        if exact:
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


@pytest.mark.parametrize("quant,kind", [("Q8_0", GGUFLinear), ("Q4_0", Int4Linear)])
@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_gguf_experts_run_as_stored(tiny_moe_dirs, tmp_path, family, quant, kind):
    """A GGUF's stacks of quantized experts run as stored, one kernel per expert (they were dequantized to fp32 and
    requantized to int8: a model of 30B parameters then needed more memory than its file by 2x), with the
    dequantized fp32 model's logprobs (to the Q8 rounding of the activations), and the memory plan counts them at
    the file's bytes. Mixtral's MoE layers run in the fused stack (the prompts' rows too: kernel_max_rows 64),
    Qwen2-MoE's (a shared expert) layer by layer."""
    from test_families import write_gguf

    from pagedlm.model.plan import estimate_weight_bytes

    path = write_gguf(tiny_moe_dirs[family], tmp_path / f"moe-{quant}.gguf", family, quant=quant)
    llm = LLM(str(path), num_kv_blocks=64, kernel_max_rows=64)
    runner = llm.engine.runner
    fused = runner.model.decode_kernel()
    assert (fused is not None and all(layer.router for layer in fused._layers)) == (
        family == "mixtral" and load_decode_kernel() is not None)
    experts = [m for e in runner.model.layers[1].mlp.experts for m in (e.gate_up_proj, e.down_proj)]
    assert all(isinstance(m, kind) for m in experts)
    assert estimate_weight_bytes(path, llm.engine.plan) == pytest.approx(runner.weight_bytes(), rel=0.02)
    ref = LLM(str(path), dtype="float32", num_kv_blocks=64)  # the blocks dequantized, fp32 products
    prompts = [[5, 9, 30, 41, 17], list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outs, refs = llm.generate(prompts, params, use_tqdm=False), ref.generate(prompts, params, use_tqdm=False)
    for ours, theirs, prompt in zip(outs, refs, prompts):
        for pos in range(1, len(prompt)):
            tid = prompt[pos]
            assert abs(ours.prompt_logprobs[pos][tid].logprob - theirs.prompt_logprobs[pos][tid].logprob) < 0.03


def _expected_routed(prompts: list[list[int]], outs, top_k: int, moe_layers: int) -> int:
    """Every prompt token and every generated token but the last passes through each MoE layer once."""
    passed = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return passed * top_k * moe_layers


def test_engine_stats_count_expert_tokens(tiny_moe_dirs):
    path = tiny_moe_dirs["qwen2-moe"]  # layer 0 dense, layer 1 (the last) with experts
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, speculative_config="off")
    prompts = [list(range(3, 3 + n)) for n in (4, 11, 27)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.get_stats().moe_expert_tokens
    assert list(stats) == [1] and len(stats[1]) == 8
    if load_decode_kernel() is None:
        assert sum(stats[1]) == _expected_routed(prompts, outs, 2, 1)
    else:  # the fused stack's last layer runs its MLP for the rows whose logits are read: one per generated token
        assert sum(stats[1]) == sum(len(o.outputs[0].token_ids) for o in outs) * 2
    llm.engine.runner.model._decode_kernel = None  # layer by layer: every token fed passes the layer
    before = sum(llm.engine.get_stats().moe_expert_tokens[1])
    prompts = [list(range(100, 100 + n)) for n in (4, 11, 27)]  # other prompts: none of it in the prefix cache
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert sum(llm.engine.get_stats().moe_expert_tokens[1]) - before == _expected_routed(prompts, outs, 2, 1)


def test_metrics_expert_counters_add_up(tiny_moe_dirs):
    from pagedlm.config import LoopConfig
    from pagedlm.engine.async_engine import AsyncLLMEngine
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.server.api import build_app

    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_moe_dirs["mixtral"]), dtype="float32", num_kv_blocks=64),
                            LoopConfig.offline(log_interval=0))
    server = InProcessServer(build_app({"tiny-mixtral": engine}))
    try:
        prompts = [[7, 8, 9, 10, 11], list(range(40, 53))]
        r = server.post("/v1/completions", json={"model": "tiny-mixtral", "prompt": prompts, "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 * 5
        server.wait_idle()
        samples = server.metrics(all_labels=True)
        routed = {k: v for k, v in samples.items() if k.startswith("pagedlm:moe_expert_tokens_total{")}
        assert len(routed) == 2 * 8  # both layers, all experts, labelled
        assert "pagedlm:moe_expert_tokens_total{expert=7,layer=1,model_name=tiny-mixtral}" in routed
        passed = sum(len(p) for p in prompts) + 2 * (5 - 1)  # the last generated token is never fed back

        def layer(i: int) -> float:
            return sum(v for k, v in routed.items() if f"layer={i}," in k)
        assert layer(0) == passed * 2  # x top-2
        # the fused stack runs the last layer's MLP only for the rows whose logits are read: one per generated token
        assert layer(1) == (2 * 5 if load_decode_kernel() is not None else passed) * 2
        text = httpx.get(f"{server.url}/metrics").text
        assert "# TYPE pagedlm:moe_expert_tokens_total counter" in text
    finally:
        server.stop()
        engine.shutdown()


def test_bench_reports_expert_balance(tiny_moe_dirs, tmp_path, capsys):
    import json

    from pagedlm.bench.offline import expert_balance
    from pagedlm.cli import main

    assert expert_balance({}) is None
    bal = expert_balance({0: [6, 2, 0, 0], 3: [2, 2, 2, 2]})
    assert (bal["max_over_mean"], bal["worst_layer"], bal["worst_layer_max_over_mean"]) == (2.0, 0, 3.0)
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(tiny_moe_dirs["mixtral"]), "--dtype", "float32",
                 "--backends", "pagedlm", "--num-prompts", "2", "--input-len", "4", "--output-len", "3",
                 "--repeats", "1", "--num-kv-blocks", "32", "--output-json", str(out)]) == 0
    assert "expert load (pagedlm, whole run)" in capsys.readouterr().out
    data = json.loads(out.read_text())["expert_balance"]
    # warm-up (2 prompts x 4 new tokens) and the run (2 x 3), prompts of 4 tokens, x top-2: the first layer routes
    # every token fed, the fused stack's last layer one row per generated token
    passed, generated = 2 * (4 + 3) + 2 * (4 + 2), 2 * 4 + 2 * 3
    last = generated if load_decode_kernel() is not None else passed
    assert data["routed_tokens"] == (passed + last) * 2 and data["max_over_mean"] >= 1.0
