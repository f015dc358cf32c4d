"""GGUF tensor names in Hugging Face naming: llama.cpp's names per architecture and the HF parameter each one is."""
from __future__ import annotations

import re

from pagedlm.hub.registry import ModelLoadError

__all__ = ["ARCH_BLOCK_NAMES", "hf_name"]

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Experts: llama.cpp stacks them into one [experts, out, in] tensor per projection ("{}": the expert index).
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
ARCH_BLOCK_NAMES = {
    "llama": {**_BLOCK_NAMES, **_MOE_NAMES},  # LLaMA, Mistral, Mixtral
    "gemma3": _GEMMA3_BLOCK_NAMES,
    "qwen2": _BLOCK_NAMES,
    "smollm3": _BLOCK_NAMES,
    "qwen3": {**_BLOCK_NAMES, **_QK_NORM_NAMES},
    "phi3": {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused as in HF
    "qwen2moe": {**_BLOCK_NAMES, **_MOE_NAMES, **_SHARED_EXPERT_NAMES},
    "qwen3moe": {**_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES},
    "olmoe": {**_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES},
}
_IGNORED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor ("{}" in it for a stack of experts), None for a tensor not loaded as a weight."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = ARCH_BLOCK_NAMES[arch]
    if m and m[2] in names:
        return f"model.layers.{m[1]}.{names[m[2]]}.{suffix}"
    if base in _IGNORED:
        return None
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
