"""KV memory arithmetic made visible: bytes per token, blocks, tokens that fit, concurrency."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedlm.config import ModelConfig
from pagedlm.kvcache.kv_cache import KVCacheSpec


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class MemoryReport:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    scale_bytes: int  # per token and kv head, for int8/fp8 caches (0 otherwise)
    kv_bytes_per_token: int
    block_size: int
    bytes_per_block: int
    num_blocks: int
    num_cpu_blocks: int
    kv_cache_bytes: int
    tokens_capacity: int
    max_model_len: int
    max_concurrency: float  # sequences of max_model_len that fit at once

    @classmethod
    def build(cls, cfg: ModelConfig, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int,
              max_model_len: int) -> "MemoryReport":
        blocks_per_seq = -(-max_model_len // spec.block_size)
        return cls(
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            dtype=str(spec.dtype).removeprefix("torch."), dtype_bytes=spec.dtype.itemsize,
            scale_bytes=spec.entry_dim - spec.head_dim,
            kv_bytes_per_token=spec.bytes_per_token, block_size=spec.block_size,
            bytes_per_block=spec.bytes_per_block, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks,
            kv_cache_bytes=num_blocks * spec.bytes_per_block, tokens_capacity=num_blocks * spec.block_size,
            max_model_len=max_model_len, max_concurrency=num_blocks / blocks_per_seq)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        entry = f"{self.head_dim} head_dim x {self.dtype_bytes} B ({self.dtype})"
        if self.scale_bytes:
            entry = f"({entry} + {self.scale_bytes} B scale)"
        return "\n".join([
            "KV cache memory report",
            f"  KV bytes per token : 2 x {self.num_layers} layers x {self.num_kv_heads} kv_heads x "
            f"{entry} = {self.kv_bytes_per_token:,} B ({_fmt_bytes(self.kv_bytes_per_token)})",
            f"  block size         : {self.block_size} tokens = {_fmt_bytes(self.bytes_per_block)}",
            f"  KV cache           : {self.num_blocks:,} blocks = {_fmt_bytes(self.kv_cache_bytes)}"
            + (f" (+ {self.num_cpu_blocks:,} host swap blocks)" if self.num_cpu_blocks else ""),
            f"  tokens that fit    : {self.tokens_capacity:,}",
            f"  max concurrency    : {self.max_concurrency:.2f} sequences of {self.max_model_len:,} tokens",
        ])
