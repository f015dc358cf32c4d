"""The interface every paged attention backend implements."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedlm.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """How a layer's new K/V get into the paged cache and how its queries read it back.

    Shapes: q [num_tokens, heads, head_dim]; k, v [num_tokens, kv_heads, head_dim]; k_cache, v_cache
    [num_blocks, block_size, kv_heads, entry_dim] (kvcache/format.py: head_dim, plus the scale of a quantized
    entry), of the cache's element dtype. `meta` is the batch of the layer's KV cache group. A backend holds no
    per-batch state: one instance serves every layer and step.
    """

    name: str
    supports_fused_decode: bool = False
    """Whether the fused decoder stack (model/llama_decode.py) may stand in for this backend's attention: it
    computes the same attention as the compiled CPU kernel, so only that backend says yes."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' K and V at `slot_mapping` ([num_tokens] int64, `block * block_size + offset`),
        quantizing them for an int8/fp8 cache. The cache layout is the same for every backend."""
        from pagedlm.attention.reference import write_kv

        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                      num_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> bool:
        """RoPE and `write_kv` fused, on a fused projection `qkv` [num_tokens, (heads + 2 kv_heads) * head_dim]:
        rotate its q and k in place (cos, sin: [num_tokens, 1, head_dim / 2]) and store k, v at their slots.
        Returns False, having changed nothing, where it does not take these tensors; the caller then rotates and
        calls `write_kv`. Any backend reads what this writes: this one uses the compiled CPU kernel
        (attention/cpu_kernel.py) wherever it takes the layout (fp32 on the CPU)."""
        from pagedlm.attention.cpu_kernel import rope_write_kv

        return rope_write_kv(qkv, cos, sin, num_heads, num_kv_heads, k_cache, v_cache, slot_mapping)

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """Causal attention of the batch's queries over their sequences' cached K/V (the new tokens' K/V already
        written): query j of sequence i sits at position `seq_lens[i] - query_lens[i] + j` and attends to every
        cached position <= its own, and with a sliding window only to those > its own - window (blocks wholly
        before the window may be freed and are never read). Returns [num_tokens, heads, head_dim] in q's dtype."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
