"""Block bookkeeping for the paged KV cache: which physical blocks each sequence owns. No tensors here.

Contract: a physical block is owned by the block tables that list it; its ref count equals that number.
`free` drops one reference per block of the sequence and a block returns to its pool's free list when its
count reaches zero. Anything that must move data (copy-on-write, swap) is returned to the caller as
(src, dst) block pairs: the engine performs the copies before the next forward pass.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol


class SeqLike(Protocol):
    seq_id: int
    num_computed_tokens: int


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """A fixed set of physical blocks on one device with a free list and reference counts."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise NoFreeBlocksError("out of KV cache blocks")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


class BlockManager:
    """Per-sequence block tables over a device pool, plus a host pool for swapped-out sequences.

    A sequence's table covers its first `num_computed_tokens` tokens plus whatever `allocate` /
    `append_slots` reserved for the tokens scheduled next. While swapped out, its table lists host blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_tables: dict[int, list[int]] = {}

    # --- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.gpu.num_blocks

    def usage(self) -> float:
        return 1.0 - self.gpu.num_free / max(self.gpu.num_blocks, 1)

    def get_block_table(self, seq: SeqLike) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _new_blocks_needed(self, seq: SeqLike, num_new_tokens: int) -> int:
        table = self.block_tables.get(seq.seq_id, [])
        need = max(0, self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table))
        if self._needs_cow(seq, table):
            need += 1
        return need

    def _needs_cow(self, seq: SeqLike, table: list[int]) -> bool:
        """The block the next token goes into already holds tokens and has other owners."""
        idx = seq.num_computed_tokens // self.block_size
        return (seq.num_computed_tokens % self.block_size != 0 and idx < len(table)
                and self.gpu.ref_counts[table[idx]] > 1)

    # --- allocation ----------------------------------------------------------------------------------
    def can_allocate(self, seqs: list[SeqLike], num_new_tokens: list[int]) -> bool:
        """Room to admit new work (a waiting request's prefill chunk) while keeping the watermark free."""
        need = sum(self._new_blocks_needed(s, n) for s, n in zip(seqs, num_new_tokens))
        return self.gpu.num_free - need >= self.watermark_blocks

    def allocate(self, seq: SeqLike, num_new_tokens: int) -> list[tuple[int, int]]:
        return self.append_slots(seq, num_new_tokens)

    def can_append_slots(self, seqs: list[SeqLike], num_new_tokens: list[int]) -> bool:
        need = sum(self._new_blocks_needed(s, n) for s, n in zip(seqs, num_new_tokens))
        return need <= self.gpu.num_free

    def append_slots(self, seq: SeqLike, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for the next `num_new_tokens` tokens. Returns copy-on-write pairs (src, dst):
        the shared, partly filled block the new tokens go into is replaced by a private copy."""
        table = self.block_tables.setdefault(seq.seq_id, [])
        copies = []
        if self._needs_cow(seq, table):
            idx = seq.num_computed_tokens // self.block_size
            src = table[idx]
            dst = self.gpu.allocate()
            self.gpu.decref(src)
            table[idx] = dst
            copies.append((src, dst))
        while len(table) < self._blocks_for(seq.num_computed_tokens + num_new_tokens):
            table.append(self.gpu.allocate())
        return copies

    def fork(self, parent: SeqLike, child: SeqLike) -> None:
        """The child shares every block of the parent (ref counts up); copies happen later, on write."""
        table = self.block_tables.get(parent.seq_id, [])
        for block in table:
            self.gpu.incref(block)
        self.block_tables[child.seq_id] = list(table)

    def free(self, seq: SeqLike) -> None:
        """Drop the sequence's reference to each of its device blocks."""
        for block in self.block_tables.pop(seq.seq_id, []):
            self.gpu.decref(block)

    # --- swapping ----------------------------------------------------------------------------------------
    def _distinct(self, seqs: list[SeqLike]) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in self.block_tables.get(s.seq_id, [])))

    def can_swap_out(self, seqs: list[SeqLike]) -> bool:
        return len(self._distinct(seqs)) <= self.cpu.num_free

    def swap_out(self, seqs: list[SeqLike]) -> list[tuple[int, int]]:
        """Move the sequences' device blocks to host blocks. A block shared among `seqs` is copied once."""
        return self._move(seqs, self.gpu, self.cpu)

    def can_swap_in(self, seqs: list[SeqLike], num_new_tokens: list[int] | None = None) -> bool:
        extra = len(seqs) if num_new_tokens is None else sum(
            self._blocks_for(s.num_computed_tokens + n) - self._blocks_for(s.num_computed_tokens) + 1
            for s, n in zip(seqs, num_new_tokens))
        return len(self._distinct(seqs)) + extra <= self.gpu.num_free - self.watermark_blocks

    def swap_in(self, seqs: list[SeqLike]) -> list[tuple[int, int]]:
        return self._move(seqs, self.cpu, self.gpu)

    def _move(self, seqs: list[SeqLike], src_pool: BlockPool, dst_pool: BlockPool) -> list[tuple[int, int]]:
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = self.block_tables.get(seq.seq_id, [])
            for i, block in enumerate(table):
                if block not in mapping:
                    mapping[block] = dst_pool.allocate()
                else:
                    dst_pool.incref(mapping[block])
                src_pool.decref(block)
                table[i] = mapping[block]
        return list(mapping.items())
