"""Block bookkeeping for the paged KV cache: which physical blocks each sequence owns. No tensors here.

Contract: a physical block is owned by the block tables that list it; its ref count equals that number.
`free` drops one reference per block of the sequence and a block returns to its pool's free list when its
count reaches zero. Anything that must move data (copy-on-write, swap) is returned to the caller as
(src, dst) block pairs: the engine performs the copies before the next forward pass.

A sequence has one block table per KV cache group (see kv_cache.py); all groups draw from the same pools. In a
sliding-window group, a block whose tokens have all left the window of the sequence's next token is freed
(`free_skipped_blocks`: its ref count drops) and its table entry becomes NULL_BLOCK, which no kernel reads.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import Protocol

import numpy as np

from pagedlm.kvcache.capacity import max_blocks_needed, max_tokens_per_seq

__all__ = ["NULL_BLOCK", "BlockManager", "BlockPool", "NoFreeBlocksError", "hash_block", "max_blocks_needed",
           "max_tokens_per_seq"]

logger = logging.getLogger(__name__)

NULL_BLOCK = -1  # table entry of a freed sliding-window block


class SeqLike(Protocol):
    seq_id: int
    num_computed_tokens: int


class CacheableSeq(SeqLike, Protocol):
    num_tokens: int
    cache_salt: str | None

    def token_slice(self, start: int, end: int) -> list[int]: ...


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None = None) -> bytes:
    """Chained, collision-resistant hash of a full block: sha256(parent hash, token ids, extra keys)."""
    h = hashlib.sha256(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if salt is not None and parent is None:
        h.update(b"salt:" + salt.encode())
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """A fixed set of physical blocks on one device with a free list and reference counts.

    The free list is LRU-ordered: `allocate` takes the block released longest ago. A freed block that
    holds a cached prefix (`block_hash` set) keeps its contents and hash until it is allocated again, and
    can be revived by `incref` meanwhile; freed blocks without a hash go to the front, to be reused first.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[list[int] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.num_evicted = 0  # cached prefixes dropped (their block reused, or unregistered)
        # KV events for a router (vLLM's BlockStored / BlockRemoved): (stored?, hash) per change of `cached`,
        # recorded only while a consumer set it to a list; it drains them (`drain_events`).
        self.events: list[tuple[bool, bytes]] | None = None

    def drain_events(self) -> list[tuple[bool, bytes]]:
        events, self.events = self.events or [], []
        return events

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise NoFreeBlocksError("out of KV cache blocks")
        block, _ = self.free_blocks.popitem(last=False)
        self._evict(block)
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            assert self.block_hash[block] is not None, f"block {block} is free"
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None
            if self.block_hash[block] is None:
                self.free_blocks.move_to_end(block, last=False)

    def register(self, block: int, block_hash: bytes, token_ids: list[int]) -> None:
        if block_hash not in self.cached and self.block_hash[block] is None:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash
            self.block_tokens[block] = token_ids
            if self.events is not None:
                self.events.append((True, block_hash))

    def unregister(self, block: int) -> None:
        """Forget the prefix the block holds (its contents are not that prefix's KV)."""
        self._evict(block)
        if self.ref_counts[block] == 0 and block in self.free_blocks:
            self.free_blocks.move_to_end(block, last=False)

    def lookup(self, block_hash: bytes, token_ids: list[int]) -> int | None:
        """The cached block with this hash, verified against its stored token ids."""
        block = self.cached.get(block_hash)
        if block is None or self.block_tokens[block] != token_ids:
            return None
        return block

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.num_evicted += 1
            del self.cached[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
            if self.events is not None:
                self.events.append((False, h))


class BlockManager:
    """Per-sequence block tables over a device pool, plus a host pool for swapped-out sequences.

    `sliding_windows` has one entry per KV cache group (None: full attention; default: one full group). A
    sequence's tables cover its first `num_computed_tokens` tokens plus whatever `allocate` / `append_slots`
    reserved for the tokens scheduled next. While swapped out, its tables list host blocks. Prefix caching
    needs every cached block to hold all layers of its tokens, so it is off for models with sliding layers."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, watermark: float = 0.01,
                 enable_prefix_caching: bool = False, sliding_windows: list[int | None] | None = None) -> None:
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_blocks)
        self.sliding_windows = list(sliding_windows or [None])
        self.num_groups = len(self.sliding_windows)
        self.has_sliding = any(w is not None for w in self.sliding_windows)
        if enable_prefix_caching and self.has_sliding:
            logger.info("Prefix caching is disabled: the model has sliding-window layers, whose blocks are freed "
                        "once they leave the window.")
            enable_prefix_caching = False
        self.block_tables: dict[int, list[list[int]]] = {}  # seq id -> one table per group
        self.swapped: set[int] = set()  # seq ids whose tables list host blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.seq_hashes: dict[int, list[bytes]] = {}  # chain hashes of each sequence's full blocks
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up in the prefix cache / found cached

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.gpu.num_blocks

    def usage(self) -> float:
        return 1.0 - self.gpu.num_free / max(self.gpu.num_blocks, 1)

    def get_block_tables(self, seq: SeqLike) -> list[list[int]]:
        """The sequence's table of each group (empty tables if it holds no blocks)."""
        return self.block_tables.get(seq.seq_id) or [[] for _ in range(self.num_groups)]

    def get_block_table(self, seq: SeqLike, group: int = 0) -> list[int]:
        return self.get_block_tables(seq)[group]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _new_blocks_needed(self, seq: SeqLike, num_new_tokens: int) -> int:
        total = self._blocks_for(seq.num_computed_tokens + num_new_tokens)
        if (tables := self.block_tables.get(seq.seq_id)) is None:
            return total * self.num_groups
        return sum(max(0, total - len(t)) + self._needs_cow(seq, t) for t in tables)

    def _needs_cow(self, seq: SeqLike, table: list[int]) -> bool:
        """The block the next token goes into already holds tokens and has other owners."""
        idx = seq.num_computed_tokens // self.block_size
        return (seq.num_computed_tokens % self.block_size != 0 and idx < len(table)
                and self.gpu.ref_counts[table[idx]] > 1)

    def max_blocks_needed(self, prompt_len: int, total_len: int, width: int = 1, max_chunk: int | None = None) -> int:
        return max_blocks_needed(self.sliding_windows, self.block_size, prompt_len, total_len, width, max_chunk)

    def max_tokens_per_seq(self, max_chunk: int | None = None) -> int:
        return max_tokens_per_seq(self.sliding_windows, self.block_size, self.gpu.num_blocks, max_chunk)

    def find_cached_prefix(self, seq: CacheableSeq) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence that has no blocks yet. The block with the
        last token is never matched: at least one token is always computed, to produce logits."""
        if not self.enable_prefix_caching or seq.num_computed_tokens or self.block_tables.get(seq.seq_id):
            return []
        hashes = self._chain_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        blocks = []
        for i, h in enumerate(hashes):
            block = self.gpu.lookup(h, seq.token_slice(i * self.block_size, (i + 1) * self.block_size))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _chain_hashes(self, seq: CacheableSeq, num_blocks: int) -> list[bytes]:
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_slice(i * bs, (i + 1) * bs),
                                     getattr(seq, "cache_salt", None)))
        return hashes[:num_blocks]

    def commit(self, seq: CacheableSeq, num_tokens: int) -> None:
        """Register in the prefix cache the sequence's blocks that are full once its first `num_tokens`
        tokens are computed. Called when those tokens are scheduled: every K/V of a step is written before
        any attention of that step reads it, so a request scheduled later in the same step may share them."""
        if not self.enable_prefix_caching:
            return
        table = self.get_block_table(seq)
        full = min(num_tokens // self.block_size, len(table))
        bs = self.block_size
        for i, h in enumerate(self._chain_hashes(seq, full)):
            if self.gpu.block_hash[table[i]] != h:  # registered before: nothing to do (and no token slice)
                self.gpu.register(table[i], h, seq.token_slice(i * bs, (i + 1) * bs))

    def uncommit(self, seq: SeqLike) -> None:
        """Undo `commit` for the tokens from `num_computed_tokens` on: the step that was to write their K/V did
        not complete, so the blocks holding them leave the prefix cache (the blocks before stay)."""
        if not self.enable_prefix_caching:
            return
        for block in self.get_block_table(seq)[seq.num_computed_tokens // self.block_size:]:
            if block != NULL_BLOCK and self.gpu.block_hash[block] is not None:
                self.gpu.unregister(block)

    def can_allocate(self, seqs: list[SeqLike], num_new_tokens: list[int],
                     cached: list[list[int]] | None = None) -> bool:
        """Room to admit new work (a waiting request's prefill chunk, after its `cached` prefix blocks)
        while keeping the watermark free. Reviving a cached block that is free also takes a free block."""
        cached = cached or [[] for _ in seqs]
        need = 0
        for s, n, hit in zip(seqs, num_new_tokens, cached):
            if hit:  # prefix caching: a single group
                total = self._blocks_for(len(hit) * self.block_size + n)
                need += total - len(hit) + sum(1 for b in set(hit) if self.gpu.ref_counts[b] == 0)
            else:
                need += self._new_blocks_needed(s, n)
        return self.gpu.num_free - need >= self.watermark_blocks

    def allocate(self, seq: SeqLike, num_new_tokens: int, cached: list[int] | None = None) -> list[tuple[int, int]]:
        """Admit a sequence: take its cached prefix blocks (ref counts up; the caller advances
        `num_computed_tokens` past them first) and reserve slots for its next `num_new_tokens` tokens."""
        cached = cached or []
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(cached) * self.block_size
        for block in cached:
            self.gpu.incref(block)
        if cached:
            self.block_tables[seq.seq_id] = [list(cached)]
        return self.append_slots(seq, num_new_tokens)

    def can_append_slots(self, seqs: list[SeqLike], num_new_tokens: list[int]) -> bool:
        need = sum(self._new_blocks_needed(s, n) for s, n in zip(seqs, num_new_tokens))
        return need <= self.gpu.num_free

    def append_slots(self, seq: SeqLike, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for the next `num_new_tokens` tokens in every group. Returns copy-on-write pairs
        (src, dst): a shared, partly filled block the new tokens go into is replaced by a private copy."""
        tables = self.block_tables.get(seq.seq_id)
        if tables is None:
            tables = self.block_tables[seq.seq_id] = [[] for _ in range(self.num_groups)]
        total = self._blocks_for(seq.num_computed_tokens + num_new_tokens)
        copies = []
        for table in tables:
            if self._needs_cow(seq, table):
                idx = seq.num_computed_tokens // self.block_size
                src = table[idx]
                dst = self.gpu.allocate()
                self.gpu.decref(src)
                table[idx] = dst
                copies.append((src, dst))
            while len(table) < total:
                table.append(self.gpu.allocate())
        return copies

    def free_skipped_blocks(self, seq: SeqLike) -> None:
        """In each sliding-window group, drop the sequence's reference to every block whose tokens are all
        at positions < num_computed_tokens - window + 1: no query from the next token on reads them."""
        tables = self.block_tables.get(seq.seq_id)
        if tables is None or not self.has_sliding:
            return
        for table, window in zip(tables, self.sliding_windows):
            if window is None:
                continue
            i = min(len(table), max(0, seq.num_computed_tokens - window + 1) // self.block_size) - 1
            while i >= 0 and table[i] != NULL_BLOCK:  # the freed blocks are a prefix of the table
                self.gpu.decref(table[i])
                table[i] = NULL_BLOCK
                i -= 1

    def truncate(self, seq: SeqLike, num_tokens: int) -> None:
        """Drop the device blocks past the first `num_tokens` tokens in every group (a rejected draft's slots: never
        committed). The kept last block may hold a rejected K/V past `num_tokens`, overwritten by the next token."""
        tables = self.block_tables.get(seq.seq_id)
        if tables is None or seq.seq_id in self.swapped:
            return
        keep = self._blocks_for(num_tokens)
        for table in tables:
            while len(table) > keep:
                block = table.pop()
                if block != NULL_BLOCK:
                    assert self.gpu.block_hash[block] is None, f"block {block} past token {num_tokens} is cached"
                    self.gpu.decref(block)

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        """The child shares every block of the parent (ref counts up); copies happen later, on write."""
        tables = self.get_block_tables(parent)
        for table in tables:
            for block in table:
                if block != NULL_BLOCK:
                    self.gpu.incref(block)
        self.block_tables[child.seq_id] = [list(t) for t in tables]
        if parent.seq_id in self.seq_hashes:
            self.seq_hashes[child.seq_id] = list(self.seq_hashes[parent.seq_id])

    def free(self, seq: SeqLike) -> None:
        """Drop the sequence's reference to each of its blocks (host blocks if it is swapped out), tail first,
        so that with prefix caching the end of a chain is evicted before its beginning."""
        pool = self.cpu if seq.seq_id in self.swapped else self.gpu
        self.swapped.discard(seq.seq_id)
        for table in self.block_tables.pop(seq.seq_id, []):
            for block in reversed(table):
                if block != NULL_BLOCK:
                    pool.decref(block)
        self.seq_hashes.pop(seq.seq_id, None)

    def _distinct(self, seqs: list[SeqLike]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for t in self.block_tables.get(s.seq_id, []) for b in t
                                  if b != NULL_BLOCK))

    def can_swap_out(self, seqs: list[SeqLike]) -> bool:
        return len(self._distinct(seqs)) <= self.cpu.num_free

    def swap_out(self, seqs: list[SeqLike]) -> list[tuple[int, int]]:
        """Move the sequences' device blocks to host blocks. A block shared among `seqs` is copied once."""
        self.swapped.update(s.seq_id for s in seqs)
        return self._move(seqs, self.gpu, self.cpu)

    def can_swap_in(self, seqs: list[SeqLike], num_new_tokens: list[int] | None = None) -> bool:
        extra = len(seqs) if num_new_tokens is None else sum(
            self._blocks_for(s.num_computed_tokens + n) - self._blocks_for(s.num_computed_tokens) + 1
            for s, n in zip(seqs, num_new_tokens))
        return len(self._distinct(seqs)) + extra * self.num_groups <= self.gpu.num_free - self.watermark_blocks

    def swap_in(self, seqs: list[SeqLike]) -> list[tuple[int, int]]:
        self.swapped.difference_update(s.seq_id for s in seqs)
        return self._move(seqs, self.cpu, self.gpu)

    def _move(self, seqs: list[SeqLike], src_pool: BlockPool, dst_pool: BlockPool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in seqs:
            for table in self.block_tables.get(seq.seq_id, []):
                for i, block in enumerate(table):
                    if block == NULL_BLOCK:
                        continue
                    if block not in mapping:
                        mapping[block] = dst_pool.allocate()
                    else:
                        dst_pool.incref(mapping[block])
                    src_pool.decref(block)
                    table[i] = mapping[block]
        return list(mapping.items())
