"""Paged attention through torch's fused scaled_dot_product_attention, one sequence at a time."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlm.attention.backend import AttentionBackend
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.attention.reference import gather_kv, window_start


def paged_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         sliding_window: int | None = None) -> torch.Tensor:
    num_heads = q.shape[1]
    kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.query_lens_list)):
        lo = window_start(seq_len, q_len, sliding_window)
        k = gather_kv(k_cache, meta.block_tables[i], seq_len, lo)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len, lo)
        qi = q[starts[i]:starts[i] + q_len].transpose(0, 1)  # [H, q, D]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, S, D]
        if q_len == 1:
            mask = None
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            k_pos = torch.arange(lo, seq_len).unsqueeze(0)
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(qi, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=kv_heads != num_heads)
        out[starts[i]:starts[i] + q_len] = o.transpose(0, 1)
    return out


class SdpaBackend(AttentionBackend):
    """`paged_attention_sdpa`: any device torch runs on (the CUDA path, and the CPU one without the kernel)."""

    name = "sdpa"

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        return paged_attention_sdpa(q, k_cache, v_cache, meta, scale, sliding_window)
