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
from pagedlm.model.llama_decode import LlamaDecodeKernel, load_decode_kernel
from pagedlm.model.loader import load_hf_config

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

NOT_FUSED = {"mistral", "qwen2", "qwen3", "mixtral", "qwen2-moe", "qwen3-moe", "olmoe"}


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
    """(name, model dir, prompts, HF's greedy reference)."""
    from transformers import AutoModelForCausalLM

    path = build_family(request.param, tmp_path_factory.mktemp(request.param))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, prompts, hf_greedy(hf, prompts, NEW_TOKENS)


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def test_batched_matches_hf(family):
    name, path, prompts, reference = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4)
    assert_matches_hf(llm.generate(prompts, PARAMS, use_tqdm=False), reference)
    if load_decode_kernel() is not None:  # biases, QK-norm, experts, windows: layer by layer; the rest fused
        assert (LlamaDecodeKernel.create(llm.engine.runner.model) is None) == (name in NOT_FUSED)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_and_preempted_matches_hf(family, mode):
    """Prefill chunks of at most 8 tokens mixed with decodes, and a KV cache too small for all four sequences."""
    name, path, prompts, reference = family
    blocks = 12 if name == "mistral" else 14  # Mistral frees blocks that left its window
    llm = LLM(str(path), dtype="float32", num_kv_blocks=blocks, block_size=4, max_num_batched_tokens=8,
              preemption_mode=mode, swap_space=1 << 20)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert_matches_hf(outs, reference)


def test_configs_match_hf(tmp_path):
    """Sliding windows, biases, QK-norm and expert layout as transformers reads them; parameter counts equal the
    HF model's (every expert counted); the served context of each RoPE scaling."""
    import transformers

    for name, (cfg_cls, model_cls, overrides) in FAMILIES.items():
        path = build_family(name, tmp_path / name)
        ours = ModelConfig.from_hf(load_hf_config(path))
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert ours.num_parameters() == sum(p.numel() for p in hf.parameters()), name
        raw = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))  # `pagedlm memory config.json`
        assert raw.num_parameters() == ours.num_parameters() and raw.rope_scaling == ours.rope_scaling, name
    cfg = ModelConfig.from_hf(load_hf_config(tmp_path / "mistral"))
    assert cfg.layer_sliding_windows == [8, 8] and not cfg.qkv_bias
    cfg = ModelConfig.from_hf(load_hf_config(tmp_path / "qwen2"))
    assert cfg.qkv_bias and not cfg.o_bias and cfg.layer_sliding_windows == [None, None]
    cfg = ModelConfig.from_hf(load_hf_config(tmp_path / "qwen2-moe"))
    assert cfg.moe_layers == [False, True] and cfg.shared_expert_intermediate_size == 96 and not cfg.norm_topk_prob
    cfg = ModelConfig.from_hf(load_hf_config(tmp_path / "mixtral"))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 2, True)
    contexts = {n: ModelConfig.from_hf(load_hf_config(tmp_path / n)).context_length for n in FAMILIES}
    assert (contexts["rope-linear"], contexts["rope-dynamic"], contexts["rope-yarn"]) == (512, 128, 256)
    assert (contexts["rope-llama3"], contexts["phi3"], contexts["llama"]) == (256, 128, 256)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*model_type 'falcon'.*Mixtral"):
        ModelConfig.from_hf(load_hf_config(tmp_path))
