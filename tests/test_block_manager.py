"""Property-based tests of the block manager's invariants under random operation sequences."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.kvcache.block_manager import BlockManager


@dataclass(eq=False)
class Seq:
    seq_id: int
    num_computed_tokens: int = 0


def check_invariants(bm: BlockManager, live: dict[int, Seq]) -> None:
    for pool, on_gpu in ((bm.gpu, True), (bm.cpu, False)):
        held = Counter()
        for sid, table in bm.block_tables.items():
            if (sid in live and getattr(live[sid], "swapped", False)) != on_gpu:
                held.update(table)
        free = set(pool.free_blocks)
        assert len(free) == len(pool.free_blocks), "a block is twice in the free list"
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == held[b], f"block {b}: ref {pool.ref_counts[b]} != holders {held[b]}"
            assert (b in free) == (held[b] == 0), f"block {b} is both free and used, or neither"
        assert len(free) + sum(1 for b in range(pool.num_blocks) if held[b]) == pool.num_blocks
    bs = bm.block_size
    for sid, seq in live.items():
        table = bm.block_tables.get(sid, [])
        assert len(table) >= -(-seq.num_computed_tokens // bs)


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "swap_out", "swap_in"]),
                         st.integers(0, 10**6), st.integers(1, 40)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
def test_random_operations_keep_invariants(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks=12, watermark=0.0)
    live: dict[int, Seq] = {}
    next_id = 0
    for op, pick, n in ops:
        ids = sorted(live)
        target = live[ids[pick % len(ids)]] if ids else None
        if op == "new":
            seq = Seq(next_id)
            next_id += 1
            if bm.can_allocate([seq], [n]):
                copies = bm.allocate(seq, n)
                assert copies == []
                seq.num_computed_tokens = n
                live[seq.seq_id] = seq
        elif target is None:
            continue
        elif getattr(target, "swapped", False):
            if op == "swap_in" and bm.can_swap_in([target]):
                pairs = bm.swap_in([target])
                assert len(pairs) == len(set(d for _, d in pairs))
                target.swapped = False
            elif op == "free":
                # a swapped sequence frees its host blocks
                for b in bm.block_tables.pop(target.seq_id, []):
                    bm.cpu.decref(b)
                del live[target.seq_id]
        elif op == "append":
            k = n % 5 + 1
            if bm.can_append_slots([target], [k]):
                before = list(bm.block_tables[target.seq_id])
                copies = bm.append_slots(target, k)
                for src, dst in copies:
                    assert src in before and dst not in before
                    assert bm.gpu.ref_counts[dst] == 1
                target.num_computed_tokens += k
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
        if getattr(seq, "swapped", False):
            for b in bm.block_tables.pop(seq.seq_id, []):
                bm.cpu.decref(b)
        else:
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
    assert bm.block_tables[0] == bm.block_tables[1]
    assert all(bm.gpu.ref_counts[b] == 2 for b in bm.block_tables[0])
    copies = bm.append_slots(child, 1)
    assert len(copies) == 1 and copies[0][0] == bm.block_tables[0][1]
    assert bm.block_tables[1][0] == bm.block_tables[0][0]  # full block still shared
    assert bm.block_tables[1][1] != bm.block_tables[0][1]
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
    assert bm.block_tables[0] == bm.block_tables[1] and bm.gpu.num_free == 6


def test_watermark_blocks_admission_but_not_append():
    bm = BlockManager(10, 4, watermark=0.2)  # 2 blocks held back
    a = Seq(0)
    assert bm.can_allocate([a], [32])  # 8 blocks, leaves 2
    assert not bm.can_allocate([a], [33])
    bm.allocate(a, 32)
    a.num_computed_tokens = 32
    assert bm.can_append_slots([a], [8])  # running sequences may dip into the watermark
