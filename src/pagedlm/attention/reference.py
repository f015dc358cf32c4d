"""Reference paged attention: plain torch, one sequence at a time. The oracle for faster kernels."""
from __future__ import annotations

import torch

from pagedlm.attention.backend import AttentionBackend
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.kvcache.format import is_quantized
from pagedlm.kvcache.quant import dequantize_kv, quantize_kv, to_cache


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([num_tokens, kv_heads, head_dim]) at their slots in the paged cache
    ([num_blocks, block_size, kv_heads, entry_dim]), quantizing them for an int8/fp8 cache (kvcache/quant.py)."""
    kv_heads, dim = k_cache.shape[-2:]
    if is_quantized(k_cache.dtype):
        k = quantize_kv(k, k_cache.dtype).view(torch.uint8)
        v = quantize_kv(v, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, to_cache(k, k_cache.dtype))
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, to_cache(v, v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, start: int = 0) -> torch.Tensor:
    """Tokens `start .. seq_len` of one sequence, gathered from its blocks: [seq_len - start, kv_heads, head_dim]
    (dequantized to float32 from an int8/fp8 cache). Blocks before the one holding `start` are not read (a
    sliding-window group may have freed them)."""
    block_size = cache.shape[1]
    first, num_blocks = start // block_size, (seq_len + block_size - 1) // block_size
    skip = first * block_size
    index = block_table[first:num_blocks].long()
    if is_quantized(cache.dtype):
        raw = cache.view(torch.uint8)[index].flatten(0, 1)[start - skip:seq_len - skip]
        return dequantize_kv(raw.view(cache.dtype))
    return cache[index].flatten(0, 1)[start - skip:seq_len - skip]


def window_start(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The first key position any of the sequence's queries reads (0 without a window)."""
    return 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim].

    Query token j of a sequence sits at position `seq_len - query_len + j` and attends to every cached
    position <= its own (and, with a sliding window, > its own - window; blocks wholly before the first
    query's window are never read). Math in float32.
    """
    num_heads = q.shape[1]
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.query_lens_list)):
        qi = q[starts[i]:starts[i] + q_len].float()  # [q, H, D]
        lo = window_start(seq_len, q_len, sliding_window)
        k = gather_kv(k_cache, meta.block_tables[i], seq_len, lo).float()  # [S - lo, KVH, D]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len, lo).float()
        qi = qi.view(q_len, kv_heads, group, -1)
        scores = torch.einsum("qhgd,shd->hgqs", qi, k) * scale  # [KVH, G, q, S - lo]
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(lo, seq_len).unsqueeze(0)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1)
        o = torch.einsum("hgqs,shd->qhgd", probs, v).reshape(q_len, num_heads, -1)
        out[starts[i]:starts[i] + q_len] = o.to(q.dtype)
    return out


class ReferenceBackend(AttentionBackend):
    """`paged_attention_reference`: the oracle, never fused."""

    name = "reference"

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, sliding_window)
