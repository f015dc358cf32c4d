"""Property-based tests of the block manager's invariants under random operation sequences."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.kvcache.block_manager import NULL_BLOCK, BlockManager


@dataclass(eq=False)
class Seq:
    seq_id: int
    num_computed_tokens: int = 0


def check_invariants(bm: BlockManager, live: dict[int, Seq]) -> None:
    for pool, on_gpu in ((bm.gpu, True), (bm.cpu, False)):
        held = Counter()
        for sid, tables in bm.block_tables.items():
            if (sid in live and getattr(live[sid], "swapped", False)) != on_gpu:
                for table in tables:
                    held.update(b for b in table if b != NULL_BLOCK)
        free = set(pool.free_blocks)
        assert len(free) == len(pool.free_blocks), "a block is twice in the free list"
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == held[b], f"block {b}: ref {pool.ref_counts[b]} != holders {held[b]}"
            assert (b in free) == (held[b] == 0), f"block {b} is both free and used, or neither"
        assert len(free) + sum(1 for b in range(pool.num_blocks) if held[b]) == pool.num_blocks
    assert bm.swapped == {sid for sid, s in live.items() if getattr(s, "swapped", False)}
    bs = bm.block_size
    for sid, seq in live.items():
        tables = bm.get_block_tables(seq)
        assert len(tables) == bm.num_groups
        for table, window in zip(tables, bm.sliding_windows):
            assert len(table) >= -(-seq.num_computed_tokens // bs)
            first_live = 0 if window is None else max(0, seq.num_computed_tokens - window + 1) // bs
            assert all(b == NULL_BLOCK for b in table[:first_live]), "a block out of the window was kept"
            assert NULL_BLOCK not in table[first_live:], "a block a query can still read was freed"
            if window is not None and len(table) == -(-seq.num_computed_tokens // bs):
                assert len(table) - first_live <= -(-window // bs) + 1


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "swap_out", "swap_in"]),
                         st.integers(0, 10**6), st.integers(1, 40)), max_size=80)
WINDOWS = [[None], [None, 3], [5, 5, None], [2], [None, 16]]


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       windows=st.sampled_from(WINDOWS))
def test_random_operations_keep_invariants(ops, num_blocks, block_size, windows):
    """Every operation on sequences with one table per KV cache group keeps ref counts equal to the number of
    table entries, and sliding-window groups hold only the blocks their window can still read."""
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks=12, watermark=0.0, sliding_windows=windows)
    live: dict[int, Seq] = {}
    next_id = 0
    for op, pick, n in ops:
        ids = sorted(live)
        target = live[ids[pick % len(ids)]] if ids else None
        if op == "new":
            seq = Seq(next_id)
            next_id += 1
            if bm.can_allocate([seq], [n]):
                free_before = bm.gpu.num_free
                copies = bm.allocate(seq, n)
                assert copies == []
                assert free_before - bm.gpu.num_free <= bm.max_blocks_needed(n, n)
                seq.num_computed_tokens = n
                bm.free_skipped_blocks(seq)
                live[seq.seq_id] = seq
        elif target is None:
            continue
        elif getattr(target, "swapped", False):
            if op == "swap_in" and bm.can_swap_in([target]):
                pairs = bm.swap_in([target])
                assert len(pairs) == len(set(d for _, d in pairs))
                target.swapped = False
            elif op == "free":  # a swapped sequence frees its host blocks
                bm.free(target)
                del live[target.seq_id]
        elif op == "append":
            k = n % 5 + 1
            if bm.can_append_slots([target], [k]):
                before = {b for t in bm.block_tables[target.seq_id] for b in t}
                free_before, need = bm.gpu.num_free, bm._new_blocks_needed(target, k)
                copies = bm.append_slots(target, k)
                assert free_before - bm.gpu.num_free == need
                for src, dst in copies:
                    assert src in before and dst not in before
                    assert bm.gpu.ref_counts[dst] == 1
                target.num_computed_tokens += k
                bm.free_skipped_blocks(target)
        elif op == "fork":
            child = Seq(next_id, target.num_computed_tokens)
            next_id += 1
            bm.fork(target, child)
            live[child.seq_id] = child
        elif op == "free":
            bm.free(target)
            del live[target.seq_id]
        elif op == "swap_out" and bm.can_swap_out([target]):
            bm.swap_out([target])
            target.swapped = True
        check_invariants(bm, live)
    for seq in list(live.values()):
        bm.free(seq)
    assert bm.gpu.num_free == num_blocks and bm.cpu.num_free == 12
    assert bm.block_tables == {}


def test_fork_then_copy_on_write_of_partial_last_block():
    bm = BlockManager(8, 4)
    parent = Seq(0)
    bm.allocate(parent, 6)  # blocks: [full, 2/4 used]
    parent.num_computed_tokens = 6
    child = Seq(1, 6)
    bm.fork(parent, child)
    assert bm.get_block_table(parent) == bm.get_block_table(child)
    assert all(bm.gpu.ref_counts[b] == 2 for b in bm.get_block_table(parent))
    copies = bm.append_slots(child, 1)
    assert len(copies) == 1 and copies[0][0] == bm.get_block_table(parent)[1]
    assert bm.get_block_table(child)[0] == bm.get_block_table(parent)[0]  # full block still shared
    assert bm.get_block_table(child)[1] != bm.get_block_table(parent)[1]
    assert bm.append_slots(parent, 1) == []  # parent is now the only owner: writes in place


def test_shared_block_swapped_once():
    bm = BlockManager(8, 4, num_cpu_blocks=8)
    a, b = Seq(0), Seq(1)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    b.num_computed_tokens = 8
    bm.fork(a, b)
    pairs = bm.swap_out([a, b])
    assert len(pairs) == 2  # two distinct blocks, each copied once
    assert bm.cpu.num_free == 6 and bm.gpu.num_free == 8
    bm.swap_in([a, b])
    assert bm.get_block_table(a) == bm.get_block_table(b) and bm.gpu.num_free == 6


def test_watermark_blocks_admission_but_not_append():
    bm = BlockManager(10, 4, watermark=0.2)  # 2 blocks held back
    a = Seq(0)
    assert bm.can_allocate([a], [32])  # 8 blocks, leaves 2
    assert not bm.can_allocate([a], [33])
    bm.allocate(a, 32)
    a.num_computed_tokens = 32
    assert bm.can_append_slots([a], [8])  # running sequences may dip into the watermark


def live_blocks(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


def test_sliding_group_frees_blocks_that_left_the_window():
    """Window 8, blocks of 4: a decoding sequence keeps ceil(8 / 4) + 1 = 3 sliding blocks however long it
    grows, the freed ones go back to the pool, and the full group keeps every block."""
    bm = BlockManager(64, 4, sliding_windows=[None, 8])
    seq = Seq(0)
    bm.allocate(seq, 5)
    seq.num_computed_tokens = 5
    for _ in range(60):
        bm.free_skipped_blocks(seq)
        full, sliding = bm.get_block_tables(seq)
        assert len(full) == len(sliding) == -(-seq.num_computed_tokens // 4)
        assert len(live_blocks(sliding)) <= 3
        assert bm.gpu.num_free == 64 - len(full) - len(live_blocks(sliding))
        bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
    first_live = (seq.num_computed_tokens - 8 + 1) // 4  # the block holding the first key a query reads
    assert sliding[first_live] != NULL_BLOCK and set(sliding[:first_live]) == {NULL_BLOCK}
    bm.free(seq)
    assert bm.gpu.num_free == 64


def test_prefill_chunk_holds_all_its_blocks_until_computed():
    """A chunk writes all its K/V before attending: its blocks stay until the step is done."""
    bm = BlockManager(64, 4, sliding_windows=[8])
    seq = Seq(0)
    assert bm._new_blocks_needed(seq, 20) == 5
    bm.allocate(seq, 20)
    assert len(live_blocks(bm.get_block_table(seq))) == 5
    seq.num_computed_tokens = 20
    bm.free_skipped_blocks(seq)  # next query at 20 reads keys 13..20: blocks 3 and 4
    assert bm.get_block_table(seq)[:3] == [NULL_BLOCK] * 3 and bm.gpu.num_free == 62
    assert bm.max_blocks_needed(1000, 1000, max_chunk=20) == -(-(20 + 8 - 1) // 4) + 1


def test_fork_swap_and_copy_on_write_with_freed_sliding_blocks():
    bm = BlockManager(32, 4, num_cpu_blocks=32, sliding_windows=[None, 4])
    parent = Seq(0)
    bm.allocate(parent, 18)  # 5 blocks per group, the last one 2/4 used
    parent.num_computed_tokens = 18
    bm.free_skipped_blocks(parent)  # window 4: keys 15.. -> sliding blocks 0-2 freed
    assert bm.get_block_table(parent, 1)[:3] == [NULL_BLOCK] * 3
    child = Seq(1, 18)
    bm.fork(parent, child)
    assert bm.gpu.num_free == 32 - 5 - 2
    copies = bm.append_slots(child, 1)  # the shared partly filled block is copied in both groups
    assert len(copies) == 2 and bm.gpu.num_free == 32 - 5 - 2 - 2
    pairs = bm.swap_out([parent, child])
    assert len(pairs) == 5 + 2 + 2 and bm.gpu.num_free == 32
    assert bm.get_block_table(child, 1)[:3] == [NULL_BLOCK] * 3
    bm.swap_in([parent, child])
    assert bm.cpu.num_free == 32
    for s in (parent, child):
        bm.free(s)
    assert bm.gpu.num_free == 32


def test_prefix_caching_is_off_with_sliding_layers():
    assert not BlockManager(8, 4, enable_prefix_caching=True, sliding_windows=[None, 8]).enable_prefix_caching
    assert BlockManager(8, 4, enable_prefix_caching=True).enable_prefix_caching
