"""Every supported LLaMA-style family and RoPE scaling against HF transformers, fp32: a tiny random-weight model
built with transformers' own config and model classes (2 layers, hidden 64), saved as safetensors; greedy tokens
identical and top-5 logprobs within 1e-3 of HF's step-by-step generation, batched and under chunked prefill with
preemption (recompute and swap). Also: the configs' facts (windows, parameter counts, context lengths), the fused
decode kernel declining what it cannot run, and a clear error for an unsupported architecture."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import assert_matches_hf, hf_greedy

from pagedlm import LLM, SamplingParams
from pagedlm.config import ModelConfig
from pagedlm.hub.loader import load_hf_config
from pagedlm.model.llama import LlamaForCausalLM
from pagedlm.model.llama_decode import LlamaDecodeKernel, load_decode_kernel

NEW_TOKENS = 16
PROMPT_LENS = (5, 12, 23, 30)  # all below 32, the original context of the dynamic / longrope models
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)

# name -> (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "rope-linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "rope-dynamic": ("LlamaConfig", "LlamaForCausalLM",
                     dict(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "rope-yarn": ("LlamaConfig", "LlamaForCausalLM",
                  dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "rope-llama3": ("LlamaConfig", "LlamaForCausalLM",
                    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4)),  # layer 3 NoPE
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(max_position_embeddings=128, original_max_position_embeddings=32,
                  rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                "long_factor": [1.5 + 0.5 * i for i in range(8)]})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, shared_expert_intermediate_size=96, mlp_only_layers=[0], **MOE)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=8, norm_topk_prob=True, **MOE)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, clip_qkv=1.0)),
}

NOT_FUSED: set[str] = set()  # families whose layers the fused decode stack does not take


def build_family(name: str, path: Path) -> Path:
    """Save the tiny random `name` model (biases, norm weights and routers randomized, so each feature matters)
    with the tiny tokenizer; returns `path`."""
    import transformers
    from conftest import build_tiny_tokenizer

    cfg_cls, model_cls, overrides = FAMILIES[name]
    tok = build_tiny_tokenizer()
    cfg = getattr(transformers, cfg_cls)(**{**BASE, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                            **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif pname.endswith(("gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.3)  # decisive routing: no near-ties between experts
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model dir, prompts, HF's greedy reference, HF's parameter count)."""
    from transformers import AutoModelForCausalLM

    path = build_family(request.param, tmp_path_factory.mktemp(request.param))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, prompts, hf_greedy(hf, prompts, NEW_TOKENS), sum(p.numel() for p in hf.parameters())


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def test_batched_matches_hf(family):
    name, path, prompts, reference, _ = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4)
    assert_matches_hf(llm.generate(prompts, PARAMS, use_tqdm=False), reference)
    if load_decode_kernel() is not None:  # experts: layer by layer; the rest fused (Qwen2's q/k/v biases too)
        assert (LlamaDecodeKernel.create(llm.engine.runner.model) is None) == (name in NOT_FUSED)


def test_chunked_and_preempted_matches_hf(family):
    """Prefill chunks of at most 8 tokens mixed with decodes, and a KV cache too small for all four sequences
    (preemption by swapping for Mistral's sliding window and for Mixtral, by recomputation for the others)."""
    name, path, prompts, reference, _ = family
    mode = "swap" if name in ("mistral", "mixtral") else "recompute"
    blocks = 12 if name == "mistral" else 14  # Mistral frees blocks that left its window
    llm = LLM(str(path), dtype="float32", num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=8,
              preemption_mode=mode, swap_space=1 << 20)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert_matches_hf(outs, reference)


def test_nope_layers_match_hf_layer_by_layer(tmp_path):
    """SmolLM3's NoPE layers through the torch layers too (the fused stack's run is test_batched_matches_hf's)."""
    from transformers import AutoModelForCausalLM

    path = build_family("smollm3", tmp_path / "smollm3")
    prompts = [list(range(3 + n, 3 + 2 * n)) for n in PROMPT_LENS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4)
    llm.engine.runner.model._decode_kernel = None  # layer by layer
    assert_matches_hf(llm.generate(prompts, PARAMS, use_tqdm=False), hf_greedy(hf, prompts, NEW_TOKENS))


EXPECTED = {  # what each config must say, beyond the parameter count
    "mistral": dict(layer_sliding_windows=[8, 8], qkv_bias=False),
    "qwen2": dict(qkv_bias=True, o_bias=False, layer_sliding_windows=[None, None]),
    "qwen3": dict(qk_norm="head", head_dim=32),
    "smollm3": dict(layer_rope=[True, True, True, False], layer_sliding_windows=[None] * 4),
    "olmoe": dict(qk_norm="full", clip_qkv=1.0, num_experts=8, moe_intermediate_size=96, norm_topk_prob=False),
    "qwen2-moe": dict(moe_layers=[False, True], shared_expert_intermediate_size=96, norm_topk_prob=False),
    "qwen3-moe": dict(moe_layers=[True, True], norm_topk_prob=True, qk_norm="head"),
    "mixtral": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "rope-linear": dict(context_length=512), "rope-dynamic": dict(context_length=128),
    "rope-yarn": dict(context_length=256), "rope-llama3": dict(context_length=256),
    "phi3": dict(context_length=128), "llama": dict(context_length=256, tie_word_embeddings=True),
}


def test_config_matches_hf(family):
    """Windows, biases, QK-norm, experts and served context as transformers reads them; the parameter count equals
    the HF model's (every expert counted); a raw config.json (`pagedlm memory config.json`) reads the same."""
    name, path, _, _, hf_params = family
    ours = ModelConfig.from_hf(load_hf_config(path))
    assert ours.num_parameters() == hf_params
    assert {k: getattr(ours, k) for k in EXPECTED[name]} == EXPECTED[name]
    assert ModelConfig.from_hf(json.loads((path / "config.json").read_text())) == ours


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*model_type 'falcon'.*Mixtral"):
        ModelConfig.from_hf(load_hf_config(tmp_path))


# --- GGUF: the same tiny models written as llama.cpp's converter writes them ----------------------------------------
GGUF_ARCH = {"llama": "llama", "rope-linear": "llama", "rope-yarn": "llama", "rope-llama3": "llama",
             "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
             "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe", "olmoe": "olmoe",
             "smollm3": "smollm3"}  # llama.cpp has no dynamic NTK
_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
            "mlp.gate_up_proj": "ffn_up",
            "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
            "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
            "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_EXPERT_TO_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                   "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_gguf(model_dir: Path, out: Path, name: str, quant: str | None = None, vocab_quant: str | None = None) -> Path:
    """An F32 GGUF of the HF model in `model_dir` under llama.cpp's names and keys: Q/K rows permuted for its llama
    architecture, experts stacked per projection, Phi-3's LongRoPE factors and Llama 3.1's as tensors; the tiny
    tokenizer is put where pagedlm caches a GGUF's converted tokenizer. `quant` (a gguf-py block type, e.g. "Q8_0"):
    the layers' matrices and stacks of experts in those blocks (not the routers); `vocab_quant`: the embedding table
    and an untied LM head in those."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from test_loader import _llama_cpp_permute
    from transformers import AutoConfig, AutoTokenizer

    arch, cfg = GGUF_ARCH[name], load_hf_config(model_dir)
    hf_cfg = AutoConfig.from_pretrained(model_dir)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch in ("qwen2moe", "qwen3moe"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if arch == "qwen3moe":
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    scaling = cfg["rope_scaling"] or {}
    if scaling.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        w.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif scaling.get("rope_type") == "llama3":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        plain = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, cfg["head_dim"], 2).float() / cfg["head_dim"]))
        w.add_tensor("rope_freqs.weight", (plain / ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)[0]).numpy())
    elif scaling.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(hf_cfg.rope_parameters["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))
    def add(gname: str, a: np.ndarray, kind: str | None = quant) -> None:
        if kind and a.ndim >= 2 and "gate_inp" not in gname:
            qt = gguf.GGMLQuantizationType[kind]
            from test_gguf_formats import QUANTIZERS  # kinds gguf-py cannot quantize

            if kind in QUANTIZERS:
                blocks = QUANTIZERS[kind](a.reshape(-1, a.shape[-1])).reshape(*a.shape[:-1], -1)
            else:
                blocks = gguf.quants.quantize(a, qt)
            w.add_tensor(gname, blocks, raw_dtype=qt)
        else:
            w.add_tensor(gname, a)

    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, t in load_file(model_dir / "model.safetensors").items():
        a = t.float().numpy()
        base, suffix = hf_name.rsplit(".", 1)
        if not base.startswith("model.layers."):
            add({"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[base]
                + f".{suffix}", a, vocab_quant)
            continue
        _, _, i, rest = base.split(".", 3)
        if ".experts." in rest:
            _, e, proj = rest.rsplit(".", 2)
            stacks.setdefault(f"blk.{i}.{_EXPERT_TO_GGUF[proj]}.{suffix}", {})[int(e)] = a
            continue
        if arch in ("llama", "smollm3") and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            a = _llama_cpp_permute(a, cfg["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"])
        if rest == "mlp.shared_expert_gate":
            a = a.reshape(-1)  # llama.cpp keeps it as a vector
        add(f"blk.{i}.{_TO_GGUF[rest]}.{suffix}", a)
    for gname, parts in stacks.items():
        add(gname, np.stack([parts[e] for e in sorted(parts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cached = out.with_name(out.name + ".tokenizer")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(cached)
    st = out.stat()
    (cached / "pagedlm_source.json").write_text(json.dumps({"source": out.name, "size": st.st_size,
                                                            "mtime_ns": st.st_mtime_ns}))
    return out


def test_gguf_matches_hf(family, tmp_path):
    """The family written as GGUF: every weight bit-identical to the safetensors load, the same architecture facts,
    and greedy tokens / logprobs equal to HF's."""
    from pagedlm.hub.loader import iter_weights

    name, path, prompts, reference, _ = family
    if name not in GGUF_ARCH:
        pytest.skip("llama.cpp has no dynamic NTK scaling")
    gguf_path = write_gguf(path, tmp_path / f"{name}.gguf", name)
    from_dir = {}
    for key, tensor in iter_weights(path):
        for old, new in LlamaForCausalLM.RENAMES if ".block_sparse_moe." in key else ():
            key = key.replace(old, new)  # Mixtral's names
        from_dir[key] = tensor
    from_gguf = dict(iter_weights(gguf_path))
    assert from_gguf.keys() == from_dir.keys()
    assert all(torch.equal(from_gguf[k], from_dir[k].reshape(from_gguf[k].shape)) for k in from_dir)
    ours, theirs = ModelConfig.from_hf(load_hf_config(gguf_path)), ModelConfig.from_hf(load_hf_config(path))
    for f in ("model_type", "layer_sliding_windows", "qkv_bias", "qk_norm", "clip_qkv", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
              "moe_layers", "context_length"):
        assert getattr(ours, f) == getattr(theirs, f), f
    llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=256, block_size=4)
    assert_matches_hf(llm.generate(prompts, PARAMS, use_tqdm=False), reference)
