"""The KV cache tensors: K and V blocks on the device, plus a host pool for swapping.

Layers are split into KV cache groups (vLLM v1's hybrid allocator): the layers of a group share one block
table per sequence, and every group has the same number of layers, so one physical block (all layers of one
group for `block_size` tokens) can serve any group and all groups draw from one pool. A model with only
full-attention layers has a single group of all its layers; Gemma 3 has groups of full-attention layers and
groups of sliding-window layers, whose blocks that slid out of the window are freed.
"""
from __future__ import annotations

import math
import mmap
import warnings
from dataclasses import dataclass

import torch

from pagedlm.config import ModelConfig
from pagedlm.kvcache.format import entry_dim, is_quantized
from pagedlm.kvcache.quant import cache_dtype


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose K/V share one block table per sequence; `sliding_window` None means full attention."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


def make_groups(layer_windows: list[int | None]) -> list[KVCacheGroup]:
    """Split the layers into groups of equal size (the gcd of the per-window layer counts), one window each:
    Gemma 3 270M (15 sliding, 3 full layers) gets five sliding groups and one full group of 3 layers."""
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(layer)
    size = math.gcd(*(len(ls) for ls in kinds.values()))
    return [KVCacheGroup(tuple(ls[i:i + size]), w) for w, ls in kinds.items() for i in range(0, len(ls), size)]


@dataclass
class KVCacheSpec:
    """`dtype` is the cache's element dtype: the model's, or int8 / float8_e4m3fn for a quantized cache, whose
    entries then carry a scale (format.SCALE_BYTES) per token and kv head (`entry_dim` = head_dim + SCALE_BYTES)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    groups: list[KVCacheGroup] | None = None  # None: one full-attention group of all layers

    def __post_init__(self) -> None:
        if self.groups is None:
            self.groups = [KVCacheGroup(tuple(range(self.num_layers)))]

    @classmethod
    def for_model(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto") -> "KVCacheSpec":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, cache_dtype(kv_cache_dtype, dtype),
                   make_groups(cfg.layer_sliding_windows))

    @property
    def layers_per_block(self) -> int:
        return len(self.groups[0].layers)

    @property
    def sliding_windows(self) -> list[int | None]:
        """The window of each group (None: full attention)."""
        return [g.sliding_window for g in self.groups]

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def entry_dim(self) -> int:
        return entry_dim(self.head_dim, self.dtype)

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer (scales included for a quantized cache)."""
        return 2 * self.num_layers * self.num_kv_heads * self.entry_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """One physical block: K and V of `block_size` tokens in the layers of one group."""
        return 2 * self.layers_per_block * self.num_kv_heads * self.entry_dim * self.element_size * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the host it is an anonymous mapping, whose pages the kernel hands out zero-filled when
    first touched: a cache of GBs costs no time at start-up (torch.zeros faults every page in, about 0.5 s per GiB
    on 2 cores) and counts in resident memory as its blocks come into use. Elsewhere torch.zeros."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    with warnings.catch_warnings():  # the mapping is writable; torch warns about every buffer it cannot check
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)


class KVCache:
    """One tensor [layers_per_block, 2, num_blocks, block_size, kv_heads, entry_dim] per device; the host copy
    has the same layout. Layer j of every group lives in slice j, addressed through that group's block tables.
    Block ids come from the BlockManager; this class only moves data. Quantized caches are stored as raw bytes
    (uint8, which every copy op supports) and handed to the layers as int8/fp8 views."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        self.spec = spec
        storage = torch.uint8 if spec.quantized else spec.dtype
        rest = (spec.block_size, spec.num_kv_heads, spec.entry_dim)
        self.gpu = zeroed((spec.layers_per_block, 2, num_blocks, *rest), storage, device)
        if device.type == "cuda":
            self.cpu = torch.zeros((spec.layers_per_block, 2, num_cpu_blocks, *rest), dtype=storage, pin_memory=True)
        else:
            self.cpu = zeroed((spec.layers_per_block, 2, num_cpu_blocks, *rest), storage, torch.device("cpu"))

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(k_cache, v_cache) of every model layer, each [num_blocks, block_size, kv_heads, entry_dim]."""
        dt = self.spec.dtype
        caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.spec.num_layers
        for group in self.spec.groups:
            for j, layer in enumerate(group.layers):
                caches[layer] = (self.gpu[j, 0].view(dt), self.gpu[j, 1].view(dt))
        return caches

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
