"""LLaMA-family decoder (LLaMA, SmolLM, Mistral-style GQA) written for serving: a flat token batch in,
K/V through the paged cache, logits only where asked for."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention import AttentionMetadata, write_kv
from pagedlm.config import ModelConfig
from pagedlm.model.layers import Linear, RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, attn_fn) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = attn_fn(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions, x, kv_cache, meta, attn_fn) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, attn_fn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names of the projections we store fused: (fused name, part, index).
    FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, attn_fn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns logits [len(logits_indices), vocab] (all tokens if None)."""
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, meta, attn_fn)
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm(x)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises on missing or unexpected tensors."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self.FUSED:
                fused, idx = self.FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                group = pending.setdefault(target, {})
                group[idx] = tensor
                if len(group) == (3 if fused == "qkv_proj" else 2):
                    self._copy(params, target, torch.cat([group[i] for i in sorted(group)], dim=0))
                    loaded.add(target)
                    del pending[target]
                continue
            if name not in params:
                raise ValueError(f"Unexpected weight {name!r} in checkpoint.")
            self._copy(params, name, tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if pending or missing:
            raise ValueError(f"Checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")

    @staticmethod
    def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        p = params[name]
        if p.shape != tensor.shape:
            raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}.")
        p.data.copy_(tensor)
