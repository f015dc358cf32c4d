"""Turns a scheduled batch into tensors and runs the model. Knows tensors, not requests."""
from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedlm import paths
from pagedlm.attention import AttentionMetadata, get_attention_backend
from pagedlm.config import EngineConfig, parse_bytes
from pagedlm.kvcache.kv_cache import KVCache, KVCacheSpec
from pagedlm.model import load_model
from pagedlm.model.plan import ExecutionPlan

logger = logging.getLogger(__name__)

DECODE_LIST_MAX_ENTRIES = 384  # block-table entries up to which a decode step's batch is built from lists


@dataclass
class Chunk:
    """Tokens `start .. start+len(token_ids)` of one sequence, whose K/V live in `block_tables` (one table per
    KV cache group; NULL_BLOCK entries are blocks a sliding-window group freed)."""

    token_ids: list[int]
    start: int
    block_tables: list[list[int]]


def weight_cache_dir(setting: str) -> Path | None:
    """EngineConfig.weight_cache as a directory (None: off)."""
    if setting == "off":
        return None
    return paths.cache_dir() / "weights" / str(os.getuid()) if setting == "auto" else Path(setting)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, plan: ExecutionPlan) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = dtype = plan.dtype
        self.model, self.model_config = load_model(model_path, dtype, self.device, plan.quantization, plan.group_size,
                                                   plan.dense_dtype, plan.kernel_max_rows,
                                                   plan.head_kernel_max_rows, plan.fallback, plan.dense_copy,
                                                   bool(plan.native_types), weight_cache_dir(config.weight_cache),
                                                   None if config.weight_cache_budget == "auto"
                                                   else parse_bytes(config.weight_cache_budget), config.huge_pages)
        self.attn_backend = get_attention_backend(config.attention_backend, config.device)
        self.block_size = config.block_size
        self.kv_spec = KVCacheSpec.for_model(self.model_config, self.block_size, self.dtype, plan.kv_cache_dtype)
        self.layer_group = [0] * self.model_config.num_layers  # layer -> its KV cache group
        for g, group in enumerate(self.kv_spec.groups):
            for layer in group.layers:
                self.layer_group[layer] = g
        self.kv_cache: KVCache | None = None
        self.moe_blocks = self.model.moe_blocks()

    def weight_bytes(self) -> int:
        """Bytes of the loaded weights as held for the run (quantized, repacked, each storage counted once)."""
        seen: dict[int, int] = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.is_floating_point() or t.dtype in (torch.int8, torch.uint8):
                try:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                except NotImplementedError:  # an opaque (oneDNN-prepacked) weight has no storage to share
                    seen[id(t)] = t.numel() * t.element_size()
        rope = getattr(self.model, "rotary", None)
        tables = {t.untyped_storage().data_ptr() for t in (rope.cos, rope.sin)} if rope is not None else set()
        return sum(n for ptr, n in seen.items() if ptr not in tables)

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.kv_cache = KVCache(self.kv_spec, num_blocks, num_cpu_blocks, self.device)
        self.layer_caches = self.kv_cache.layer_caches()

    def prepare(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """The flat batch: input ids, positions and one AttentionMetadata per KV cache group (its block tables
        and slot mapping; the sequence lengths are shared)."""
        if (all(len(c.token_ids) == 1 for c in chunks)
                and sum(len(t) for c in chunks for t in c.block_tables) <= DECODE_LIST_MAX_ENTRIES):
            return self._prepare_decode(chunks)
        bs = self.block_size
        q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        seq_lens = starts + q_lens
        cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        # positions: start of each chunk + offset within it
        offsets = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], q_lens)
        positions = np.repeat(starts, q_lens) + offsets
        seq_idx, blk, off = np.repeat(np.arange(len(chunks)), q_lens), positions // bs, positions % bs
        input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                                count=total)
        dev = self.device
        shared = dict(seq_lens=torch.from_numpy(seq_lens).to(dev, torch.int32),
                      query_start_loc=torch.from_numpy(cu).to(dev, torch.int32), seq_lens_list=seq_lens.tolist(),
                      query_lens_list=q_lens.tolist(), max_query_len=int(q_lens.max()),
                      max_seq_len=int(seq_lens.max()), block_size=bs)
        metas = []
        for g in range(len(self.kv_spec.groups)):
            # block tables in bulk: one flat array, scattered into the padded [seqs, max_blocks] table
            n_blocks = np.fromiter((len(c.block_tables[g]) for c in chunks), dtype=np.int64, count=len(chunks))
            flat = np.fromiter(itertools.chain.from_iterable(c.block_tables[g] for c in chunks), dtype=np.int64,
                               count=int(n_blocks.sum()))
            tables = np.zeros((len(chunks), int(n_blocks.max())), dtype=np.int64)
            tables[np.arange(tables.shape[1]) < n_blocks[:, None]] = flat
            if total and (blk >= n_blocks[seq_idx]).any():  # else it would write into a padding entry's block
                raise RuntimeError("a new token's position is past the end of its block table")
            slots = tables[seq_idx, blk] * bs + off
            if total and slots.min() < 0:
                raise RuntimeError("a new token's slot is in a freed block")
            np.maximum(tables, 0, out=tables)  # freed sliding-window blocks: any valid id, never read
            metas.append(AttentionMetadata(slot_mapping=torch.from_numpy(slots).to(dev),
                                           block_tables=torch.from_numpy(tables).to(dev, torch.int32), **shared))
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), metas

    def _prepare_decode(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """`prepare` for a step of one new token per sequence with short block tables, from plain lists: numpy's
        thirty-odd calls cost about 6% of a 135M decode step."""
        bs, dev, n = self.block_size, self.device, len(chunks)
        positions = [c.start for c in chunks]
        seq_lens = [p + 1 for p in positions]
        shared = dict(seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                      query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev), seq_lens_list=seq_lens,
                      query_lens_list=[1] * n, max_query_len=1, max_seq_len=max(seq_lens), block_size=bs)
        metas = []
        for g in range(len(self.kv_spec.groups)):
            tables = [c.block_tables[g] for c in chunks]
            slots = []
            for table, pos in zip(tables, positions):
                if pos // bs >= len(table):
                    raise RuntimeError("a new token's position is past the end of its block table")
                if table[pos // bs] < 0:
                    raise RuntimeError("a new token's slot is in a freed block")
                slots.append(table[pos // bs] * bs + pos % bs)
            width = max(map(len, tables))
            padded = [[max(b, 0) for b in t] + [0] * (width - len(t)) if min(t) < 0 else t + [0] * (width - len(t))
                      for t in tables]  # freed sliding-window blocks: any valid id, never read
            metas.append(AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                                           block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
                                           **shared))
        return (torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), metas)

    def execute(self, chunks: list[Chunk], logits_indices: list[int]) -> torch.Tensor:
        """Run one forward pass; returns float32 logits for the flat token positions in `logits_indices`."""
        return self.execute_with_hidden(chunks, logits_indices, None)[0]

    @torch.inference_mode()
    def execute_with_hidden(self, chunks: list[Chunk], logits_indices: list[int],
                            hidden_indices: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`execute`, and the float32 final hidden states (after the final norm) of the flat token positions in
        `hidden_indices` (pooling requests'; None: none)."""
        input_ids, positions, metas = self.prepare(chunks)
        idx = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
        hidden_idx = None if hidden_indices is None else torch.tensor(hidden_indices, dtype=torch.long,
                                                                      device=self.device)
        layer_metas = [metas[g] for g in self.layer_group]
        logits, hidden = self.model.logits_and_hidden(input_ids, positions, self.layer_caches, layer_metas,
                                                      self.attn_backend, idx, hidden_idx)
        return logits.float(), None if hidden is None else hidden.float()
