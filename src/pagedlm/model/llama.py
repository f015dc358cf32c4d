"""LLaMA-style decoders written for serving: a flat token batch in, K/V through the paged cache, logits only where
asked for. One model with options covers LLaMA / SmolLM, Mistral (sliding window), Qwen2/2.5 (q/k/v biases),
Qwen3 (QK-norm), Phi-3 (checkpoints already fused) and the mixture-of-experts families Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE (model/moe.py), as the ModelConfig of the checkpoint says."""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.attention import AttentionBackend, AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.model.base import CausalLM
from pagedlm.model.layers import ACTIVATIONS, Linear, RMSNorm, RotaryEmbedding, embedding, prefer_transposed
from pagedlm.model.llama_decode import FusedExperts, FusedLayer, FusedStack, split_bias


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm, self.clip_qkv = cfg.qk_norm, cfg.clip_qkv
        if cfg.qk_norm is not None:
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else self.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else self.kv_size, cfg.rms_norm_eps)
        self.sliding_window = sliding_window

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qk_norm is not None:
            qkv = self._norm_qk(qkv)
        if self.clip_qkv is not None:
            qkv = qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        k_cache, v_cache = kv_cache
        if backend.rope_write_kv(qkv, *rope, self.num_heads, self.num_kv_heads, k_cache, v_cache, meta.slot_mapping):
            q = qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim)  # rotated in place, k/v written
        else:
            # q and k are adjacent in the fused output: rotate them together as one [n, heads + kv_heads, dim] view.
            qk = RotaryEmbedding.apply(qkv[:, :self.q_size + self.kv_size].view(n, -1, self.head_dim), *rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(n, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """RMSNorm of q and k before RoPE: per head (Qwen3) or over the whole projection (OLMoE)."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).reshape(n, self.q_size)
            k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, self.kv_size)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        return torch.cat([q, k, v], dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        from pagedlm.model.moe import SparseMoE  # moe.py builds its experts from LlamaMLP

        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, cfg.layer_sliding_windows[index])
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.moe_layers and cfg.moe_layers[index] else LlamaMLP(cfg)
        self.rope_index = 0 if cfg.layer_rope is None or cfg.layer_rope[index] else 1  # 1: NoPE, an identity table

    def forward(self, rope, x, kv_cache, meta, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    # Mixtral's checkpoint names for what the other MoE families (and this model) call mlp.experts.E.*_proj.
    RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
               (".w2.", ".down_proj."))

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   metas: list[AttentionMetadata], backend: AttentionBackend,
                   out_qsl: torch.Tensor | None = None) -> tuple[torch.Tensor, bool, bool]:
        """The fused stack (final norm included) where the backend lets it stand in and it takes the batch, else
        layer by layer."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # once per step, shared by all layers
        # NoPE layers (SmolLM3) rotate by 0: cos 1 and sin 0 leave q and k exactly as they are
        ropes = [(cos, sin)]
        if self.cfg.layer_rope is not None:
            ropes.append((torch.ones_like(cos), torch.zeros_like(sin)))
        kernel = self.decode_kernel() if backend.supports_fused_decode else None
        tables = [c for c, _ in ropes], [s for _, s in ropes]
        if kernel is not None and kernel.run(x, *tables, kv_caches, metas, out_qsl):
            return x, True, out_qsl is not None
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
            x = layer(ropes[layer.rope_index], x, kv_cache, meta, backend)
        return x, False, False

    def fused_stack(self) -> FusedStack | None:
        """Plain LLaMA layers, with sliding windows, QK-norm per head or over the whole q/k projection and q/k/v
        clamping (OLMoE), q/k/v biases (Qwen2) and experts (Mixtral, Qwen3-MoE, Qwen2-MoE's shared one too); not
        other biases or activations other than SiLU."""
        c = self.cfg
        if c.o_bias or c.mlp_bias or c.hidden_act != "silu":
            return None
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk = (attn.q_norm.weight, attn.k_norm.weight) if c.qk_norm else (None, None)
            qkv, bias = split_bias(attn.qkv_proj)
            if isinstance(mlp, LlamaMLP):
                gate_up, down, moe = mlp.gate_up_proj, mlp.down_proj, None
            else:
                gate_up, down = None, None
                gate = mlp.shared_expert_gate.weight if mlp.shared_expert is not None else None
                moe = FusedExperts(mlp.gate.weight, mlp.top_k, mlp.norm_topk_prob, list(mlp.experts),
                                   mlp.expert_tokens, mlp.shared_expert, gate)
            layers.append(FusedLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                     qkv, attn.o_proj, gate_up, down, *qk, window=attn.sliding_window,
                                     rope=layer.rope_index, qkv_bias=bias, moe=moe,
                                     qk_norm_whole=c.qk_norm not in (None, "head"), clip_qkv=c.clip_qkv))
        return FusedStack(layers, self.norm.weight, c.hidden_act, c.head_dim ** -0.5)

    def process_weights_after_loading(self) -> None:
        """Repack the loaded weights for speed (see `Linear.process_weights_after_loading`). A tied LM head
        gets its own Linear (a copy of the embedding) when that Linear would store it in another layout."""
        table = self.embed_tokens
        if self.lm_head is None and isinstance(table, nn.Embedding) and prefer_transposed(table.weight.dtype,
                                                                                          table.weight.device):
            head = Linear(self.cfg.hidden_size, self.cfg.vocab_size)
            head.weight = nn.Parameter(table.weight.data, requires_grad=False)
            self.lm_head = head
        super().process_weights_after_loading()

    def param_name(self, name: str) -> str:
        name = super().param_name(name)
        if ".block_sparse_moe." in name:
            for old, new in self.RENAMES:
                name = name.replace(old, new)
        return name
