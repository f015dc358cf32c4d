"""The architecture facts the runtime needs (`ModelConfig`); hf.py reads them from each family's HF config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ModelConfig:
    """The architecture facts the runtime needs, read from an HF-style config dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    # Gemma 3 (None / defaults for LLaMA): per-layer "sliding_attention" | "full_attention", the window
    # (a key at position p is visible from query q iff q - window < p <= q), RoPE base of sliding layers,
    # attention scale query_pre_attn_scalar ** -0.5, tanh soft-capping, embeddings times embedding_scale.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embedding_scale: float | None = None
    # LLaMA-style families (model/llama.py): biases on q/k/v (Qwen2), on o_proj and on the MLP; QK-norm
    # ("head": an RMSNorm over each head's head_dim, Qwen3; "full": over the whole q and k projections, OLMoE),
    # OLMoE's clamp of q/k/v to +-clip_qkv.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    # Mixture of experts (num_experts 0: dense): each token's MLP output is the weighted sum of its top
    # num_experts_per_tok experts (softmax over all router logits, renormalized over the chosen ones when
    # norm_topk_prob), plus a shared expert behind a sigmoid gate where shared_expert_intermediate_size > 0
    # (Qwen2-MoE). moe_layers[i]: layer i has experts (else the dense MLP of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: list[bool] | None = None
    # SmolLM3's NoPE layers: layer_rope[i] False where layer i applies no rotary embedding (None: every layer does).
    layer_rope: list[bool] | None = None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """The attention window of each layer (None: full attention)."""
        types = self.layer_types or ["full_attention"] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers or [])

    @property
    def context_length(self) -> int:
        """The longest sequence the model serves: max_position_embeddings, stretched by linear, dynamic and YaRN
        RoPE scaling (as vLLM derives it; llama3 and longrope configs already state the stretched length)."""
        s = self.rope_scaling or {}
        kind, factor = s.get("rope_type"), s.get("factor") or 1.0
        if kind in ("linear", "dynamic"):
            return int(self.max_position_embeddings * factor)
        if kind == "yarn":
            return max(self.max_position_embeddings, int(s["original_max_position_embeddings"] * factor))
        return self.max_position_embeddings

    def num_parameters(self) -> int:
        """Parameters of the checkpoint (a tied LM head once, every expert of every MoE layer)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + self.qkv_bias * (q + 2 * kv) + self.o_bias * h
        attn += {"head": 2 * d, "full": q + kv}.get(self.qk_norm or "", 0)
        norms = 2 * h
        if self.model_type == "gemma3_text":
            attn, norms = attn + 2 * d, 4 * h

        def mlp(inter: int) -> int:
            return 3 * h * inter + self.mlp_bias * (2 * inter + h)

        moe = self.num_experts * (mlp(self.moe_intermediate_size) + h)
        if self.shared_expert_intermediate_size:
            moe += mlp(self.shared_expert_intermediate_size) + h
        flags = self.moe_layers or [False] * self.num_layers
        layers = sum(attn + norms + (moe if is_moe else mlp(self.intermediate_size)) for is_moe in flags)
        return layers + h + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """The facts of an HF `config.json` (or a GGUF's translation of one), per family (config/hf.py); ValueError
        for an architecture pagedlm does not run."""
        from pagedlm.config.hf import model_config_kwargs

        try:
            return cls(**model_config_kwargs(cfg))
        except KeyError as e:
            raise ValueError(f"The model's config lacks {e.args[0]!r}.") from None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()
