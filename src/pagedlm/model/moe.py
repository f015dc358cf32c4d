"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) over a flat token batch.

A router scores the experts of every token (softmax over all logits, in float32), keeps the top k and, where the
family says so, renormalizes their weights to sum to 1 (for Mixtral this equals a softmax over the chosen logits).
Each expert is a gated MLP of its own `layers.Linear`s, so the weight-only quantization of model/quant/ applies
to it like to any other layer. Tokens are grouped by expert: each chosen expert runs once, over exactly the tokens
that chose it (one GEMM per expert in prefill and large batches), and experts nobody chose are never read, so a
decode step of one token streams k of the E experts' weights. The router stays in full precision.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.config import ModelConfig
from pagedlm.model.layers import weight_placeholder
from pagedlm.model.llama import LlamaMLP
from pagedlm.model.llama_decode import ExpertsKernel


class Router(nn.Module):
    """Logits x @ W^T over [outputs, hidden] weights; not a layers.Linear, so quantization leaves it alone."""

    def __init__(self, hidden_size: int, num_outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_placeholder(num_outputs, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """Checkpoint names: gate (the router), experts.E.{gate,up,down}_proj, and for Qwen2-MoE shared_expert.* and
    shared_expert_gate. `expert_tokens[e]` counts the tokens routed to expert e since the model was built."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = nn.ModuleList(LlamaMLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(cfg, shared) if shared else None
        self.shared_expert_gate = Router(cfg.hidden_size, 1) if shared else None
        self.register_buffer("expert_tokens", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        self.hidden_act = cfg.hidden_act
        self._kernel: ExpertsKernel | None | bool = False  # False: not bound yet (see `_one_token`)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] in x's dtype, expert ids [tokens, k])."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.flatten()
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_tokens += counts
        if x.shape[0] == 1:
            out = self._one_token(x, weights[0].tolist(), ids[0].tolist())
        else:
            out = self._grouped(x, weights.flatten(), flat, counts.tolist())
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _one_token(self, x: torch.Tensor, weights: list[float], ids: list[int]) -> torch.Tensor:
        """Decode of a single token: its k experts, summed in expert order (as `_grouped` sums them), in one call
        of the compiled experts kernel where it reads the experts' layers (bound on first use, once the weights are
        in their final layout)."""
        chosen = sorted(zip(ids, weights))
        if self._kernel is False:
            self._kernel = ExpertsKernel.create(list(self.experts), self.hidden_act)
        if self._kernel is not None and (out := self._kernel.run(x, chosen)) is not None:
            return out
        out = torch.zeros_like(x)
        for e, w in chosen:
            out += self.experts[e](x).mul_(w)
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every (token, expert) pair sorted by expert: each expert runs one product over its rows, the weighted
        rows are added back into their tokens."""
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        rows = x[tokens]
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out_rows[start:start + n] = self.experts[e](rows[start:start + n])
                start += n
        out_rows.mul_(weights[order, None])
        return torch.zeros_like(x).index_add_(0, tokens, out_rows)
