"""Gemma 3 text decoder written for serving, numerically as HF's Gemma3ForCausalLM: interleaved sliding-window
and global attention layers with their own RoPE bases, QK-norm, GeGLU, (1 + w) RMSNorms before and after
attention and MLP, embeddings scaled by sqrt(hidden). Same forward contract as every
CausalLM (model/base.py)."""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention import AttentionBackend, AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.model.base import CausalLM
from pagedlm.model.layers import ACTIVATIONS, Linear, embedding, rope_inv_freq
from pagedlm.model.llama_decode import FusedLayer, FusedStack


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back at the end (weight is stored minus 1, as in HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Rotary(nn.Module):
    """Rotate-half RoPE with cos/sin computed from the positions at each call (HF's float32 arithmetic)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, dim / 2] each, float32 (the first half of what `forward` multiplies by; the fused stack's)."""
        freqs = positions[:, None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, dim], k: [tokens, kv_heads, dim]."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.sliding_window = sliding_window
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(n, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, sliding_window: int | None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, rotary, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, x, kv_cache, meta, backend: AttentionBackend) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, backend)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    """Its tied LM head stays the embedding table (F.linear), and the final logits are soft-capped where the
    config says so."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.attn_logit_softcapping is not None:
            raise ValueError("Gemma attention logit soft-capping is not supported by the paged attention backends.")
        super().__init__(cfg)
        self.rotary_local = Rotary(cfg.head_dim, cfg.rope_local_base_freq)
        self.rotary_global = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # linear (4B-27B) or none
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, self.rotary_global if w is None else self.rotary_local, w)
            for w in self.layer_sliding_windows)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.cfg.embedding_scale, dtype=x.dtype)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   metas: list[AttentionMetadata], backend: AttentionBackend,
                   out_qsl: torch.Tensor | None = None) -> tuple[torch.Tensor, bool, bool]:
        """The fused stack (final norm included) where the backend lets it stand in and it takes the batch, else
        layer by layer."""
        kernel = self.decode_kernel() if backend.supports_fused_decode else None
        if kernel is not None:
            tables = [self.rotary_global.cos_sin(positions), self.rotary_local.cos_sin(positions)]
            if kernel.run(x, [c for c, _ in tables], [s for _, s in tables], kv_caches, metas, out_qsl):
                return x, True, out_qsl is not None
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            x = layer(positions, x, kv_cache, meta, backend)
        return x, False, False

    def fused_stack(self) -> FusedStack | None:
        """Gemma's norms multiply by 1 + w: the stack gets those vectors (fp32, as GemmaRMSNorm computes them)."""
        def one_plus(norm: GemmaRMSNorm) -> torch.Tensor:
            return 1.0 + norm.weight.float()

        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(FusedLayer(
                one_plus(layer.input_layernorm), one_plus(layer.pre_feedforward_layernorm), attn.qkv_proj,
                attn.o_proj, mlp.gate_up_proj, mlp.down_proj, one_plus(attn.q_norm), one_plus(attn.k_norm),
                one_plus(layer.post_attention_layernorm), one_plus(layer.post_feedforward_layernorm),
                window=attn.sliding_window, rope=0 if attn.rotary is self.rotary_global else 1))
        return FusedStack(layers, one_plus(self.norm), self.cfg.hidden_act, self.cfg.query_pre_attn_scalar ** -0.5)

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(x)
        if (cap := self.cfg.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
