"""The KV cache tensors: every layer's K and V blocks on the device, plus a host pool for swapping."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.config import ModelConfig
from pagedlm.kvcache.quant import cache_dtype, entry_dim, is_quantized


@dataclass
class KVCacheSpec:
    """`dtype` is the cache's element dtype: the model's, or int8 / float8_e4m3fn for a quantized cache, whose
    entries then carry a 4-byte scale per token and kv head (`entry_dim` = head_dim + 4)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> "KVCacheSpec":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, cache_dtype(kv_cache_dtype, dtype))

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def entry_dim(self) -> int:
        return entry_dim(self.head_dim, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.entry_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class KVCache:
    """One tensor [layers, 2, num_blocks, block_size, kv_heads, entry_dim] per device; the host copy has the
    same layout. Block ids come from the BlockManager; this class only moves data. Quantized caches are stored
    as raw bytes (uint8, which every copy op supports) and handed to the layers as int8/fp8 views."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        self.spec = spec
        storage = torch.uint8 if spec.quantized else spec.dtype
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.entry_dim)
        self.gpu = torch.zeros(shape, dtype=storage, device=device)
        cpu_shape = (spec.num_layers, 2, num_cpu_blocks, spec.block_size, spec.num_kv_heads, spec.entry_dim)
        pin = device.type == "cuda"
        self.cpu = torch.zeros(cpu_shape, dtype=storage, pin_memory=pin)

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dt = self.spec.dtype
        return [(self.gpu[i, 0].view(dt), self.gpu[i, 1].view(dt)) for i in range(self.spec.num_layers)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = self._index(pairs, self.gpu.device)
        self.gpu[:, :, dst] = self.gpu[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = self._index(pairs, self.gpu.device)
        self.cpu[:, :, dst.cpu()] = self.gpu[:, :, src].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src, dst = self._index(pairs, torch.device("cpu"))
        self.gpu[:, :, dst.to(self.gpu.device)] = self.cpu[:, :, src].to(self.gpu.device)

    @staticmethod
    def _index(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(pairs, dtype=torch.long, device=device)
        return t[:, 0], t[:, 1]
