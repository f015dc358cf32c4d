"""LLaMA-family decoder (LLaMA, SmolLM, Mistral-style GQA) written for serving: a flat token batch in,
K/V through the paged cache, logits only where asked for."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention import AttentionMetadata, write_kv
from pagedlm.attention.cpu_kernel import paged_attention_cpu, rope_write_kv
from pagedlm.config import ModelConfig
from pagedlm.model.layers import Linear, RMSNorm, RotaryEmbedding, prefer_transposed
from pagedlm.model.llama_decode import LlamaDecodeKernel
from pagedlm.model.quant import Int4Blocks


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, attn_fn) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        if rope_write_kv(qkv, *rope, self.num_heads, self.num_kv_heads, k_cache, v_cache, meta.slot_mapping):
            q = qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim)  # rotated in place, k/v written
        else:
            # q and k are adjacent in the fused output: rotate them together as one [n, heads + kv_heads, dim] view.
            qk = RotaryEmbedding.apply(qkv[:, :self.q_size + self.kv_size].view(n, -1, self.head_dim), *rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
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
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, rope, x, kv_cache, meta, attn_fn) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta, attn_fn)
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
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self._decode_kernel: LlamaDecodeKernel | None | bool = False  # False: not built yet
        self.native_weights: dict[str, Int4Blocks] = {}  # checkpoint int4 blocks by parameter name (_copy)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata], attn_fn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_caches[i], metas[i]: layer i's paged K/V and the batch layout of
        its KV cache group. Returns logits [len(logits_indices), vocab] (all tokens if None)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, x.dtype)  # once per step, shared by all layers
        kernel = self.decode_kernel() if attn_fn is paged_attention_cpu else None
        normed = kernel is not None and kernel.run(x, *rope, kv_caches, metas)
        if not normed:
            for layer, kv_cache, meta in zip(self.layers, kv_caches, metas):
                x = layer(rope, x, kv_cache, meta, attn_fn)
        if logits_indices is not None:
            x = x[logits_indices]
        if not normed:
            x = self.norm(x)
        if self.lm_head is None:  # tied and not yet processed
            return F.linear(x, self.embed_tokens.weight)
        return self.lm_head(x)

    def decode_kernel(self) -> LlamaDecodeKernel | None:
        """The fused decoder stack for small steps (llama_decode.py), bound on first use: by then the weights
        are in their final layout (repacked, quantized)."""
        if self._decode_kernel is False:
            self._decode_kernel = LlamaDecodeKernel.create(self)
        return self._decode_kernel

    def process_weights_after_loading(self) -> None:
        """Repack the loaded weights for speed (see `Linear.process_weights_after_loading`). A tied LM head
        gets its own Linear (a copy of the embedding) when that Linear would store it in another layout."""
        if self.lm_head is None and prefer_transposed(self.embed_tokens.weight.dtype, self.embed_tokens.weight.device):
            head = Linear(self.cfg.hidden_size, self.cfg.vocab_size)
            head.weight = nn.Parameter(self.embed_tokens.weight.data, requires_grad=False)
            self.lm_head = head
        for m in self.modules():
            if isinstance(m, Linear):
                m.process_weights_after_loading()

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
                    parts = [group[i] for i in sorted(group)]
                    self._copy(params, target,
                               Int4Blocks.cat(parts) if isinstance(parts[0], Int4Blocks) else torch.cat(parts, dim=0))
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
        if hasattr(self, "process_weights_after_loading"):  # models borrowing this loader may not define it
            self.process_weights_after_loading()

    def _copy(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor | Int4Blocks) -> None:
        """Copy a checkpoint tensor into its parameter; int4 blocks kept as stored are set aside in
        `native_weights` for quantize_model instead."""
        p = params[name]
        if tuple(p.shape) != tuple(tensor.shape):
            raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}.")
        if isinstance(tensor, Int4Blocks):
            self.native_weights[name] = tensor
        else:
            p.data.copy_(tensor)
