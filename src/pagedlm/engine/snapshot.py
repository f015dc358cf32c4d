"""The engine's memory state as one compact, typed snapshot (`EngineSnapshot`), for the memory views (/debug/state,
/ui, `pagedlm top`).

Contract: `build_snapshot` runs on the engine thread between two steps, and only when a watcher asks
(AsyncLLMEngine.snapshot): nothing is built while nobody watches. It copies what it reads (plain lists and ints),
so the snapshot may be serialised on another thread while the engine steps on.

The block pool is run-length encoded (`[value, count, value, count, ...]`): a pool of 100k blocks whose blocks come
in runs costs a few numbers, not 100k. A block's state is FREE (no KV kept), USED (ref count > 0) or CACHED (free,
but its KV and prefix hash are kept until the block is allocated again). Who owns a block is read from the
sequences' block tables: a block with ref count r appears r times among the tables of the sequences on the device.
Counters are cumulative since the engine started; a watcher takes differences between two snapshots.

Each request's sequences are listed as a tree (`seq_tree`): a parent before its children. A sequence's `parent` is
the live sequence it was forked from (n > 1 samples after the prefill, beams chosen twice), or, where that one has
ended, its nearest live ancestor; `forked_at` is the tokens they share (the fewest along the way).
"""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.engine.scheduler import SchedulerOutput
    from pagedlm.engine.sequence import Request
    from pagedlm.engine.sequence import Sequence as Seq
    from pagedlm.kvcache.block_manager import BlockManager, BlockPool

FREE, USED, CACHED = 0, 1, 2
STATE_NAMES = ("free", "used", "cached")
MAX_HASHES = 4096  # hash display ids sent per pool; beyond, `hashes` is cut (`hashes_truncated`)
MAX_TEXT_CHARS = 200  # of a sequence's text, with --ui-show-text
MAX_BLOCK_TEXTS = 1024  # blocks whose tokens' text is sent, with --ui-show-text (decoded on the engine thread)


def run_lengths(values: Sequence[int] | np.ndarray) -> list[int]:
    """`values` as [value, count, value, count, ...] (consecutive equal values merged)."""
    a = np.asarray(values, dtype=np.int64)
    if a.size == 0:
        return []
    starts = np.flatnonzero(np.r_[True, a[1:] != a[:-1]])
    counts = np.diff(np.r_[starts, a.size])
    return np.column_stack([a[starts], counts]).ravel().tolist()


def expand_runs(runs: Sequence[int]) -> list[int]:
    """The inverse of `run_lengths`."""
    return [v for i in range(0, len(runs), 2) for v in [runs[i]] * runs[i + 1]]


@dataclass
class BlockMoves:
    """Blocks the engine copied (copy-on-write) or swapped, counted from each step's scheduler output."""

    copied: int = 0
    swapped_out: int = 0
    swapped_in: int = 0

    def record(self, sched: SchedulerOutput) -> None:
        self.copied += len(sched.blocks_to_copy)
        self.swapped_out += len(sched.blocks_to_swap_out)
        self.swapped_in += len(sched.blocks_to_swap_in)


@dataclass
class PoolSnapshot:
    """One block pool (device or host)."""

    num_blocks: int
    num_free: int
    num_used: int
    num_cached: int  # free blocks that keep a cached prefix
    state_runs: list[int]  # run-length encoded FREE / USED / CACHED per block
    ref_runs: list[int]  # run-length encoded reference count per block
    hashes: dict[int, str] = field(default_factory=dict)  # block -> display id of its prefix hash (hex prefix)
    hashes_truncated: bool = False
    texts: dict[int, str] = field(default_factory=dict)  # block -> its tokens' text (only when the server shows text)


@dataclass
class SeqSnapshot:
    """One live sequence that holds (or waits for) blocks."""

    request_id: str
    index: int  # sample index in its request
    seq_id: int
    status: str  # running | swapped | waiting
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # prompt tokens its request took from the prefix cache
    block_tables: list[list[int]]  # one per KV cache group; -1: a freed sliding-window block; host blocks if swapped
    opaque: bool = False  # its tenant salts the prefix cache: no text, no hashes
    text: str | None = None  # prompt + output so far (cut), only when the server shows text
    parent: int | None = None  # seq_id of the listed sequence it was forked from (its nearest live ancestor)
    forked_at: int = 0  # tokens it shares with `parent` (0 without one)


@dataclass
class DraftSnapshot:
    """Speculative decoding's draft model: its weights and its own KV cache (bytes), whose pool has `num_blocks`,
    `num_used` of them held by the `num_seqs` sequences it keeps K/V for."""

    model: str
    weights: int
    kv_cache: int
    per_block: int
    num_blocks: int
    num_used: int
    num_free: int
    num_seqs: int


@dataclass
class EngineSnapshot:
    """What a memory view shows of one engine; `to_dict` is its JSON shape."""

    time: float  # wall clock (seconds since the epoch)
    block_size: int
    kv_dtype: str
    num_groups: int
    prefix_caching: bool
    device: PoolSnapshot
    host: PoolSnapshot | None  # the swap space (None: none)
    seqs: list[SeqSnapshot]
    queues: dict[str, int]  # running / waiting / swapped requests, running sequences
    counters: dict[str, int]  # cumulative: preemptions, copy-on-write and swapped blocks, prefix cache, tokens
    memory: dict[str, int | None]  # bytes: weights, kv cache, per block, host RSS
    moe_expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> cumulative tokens/expert
    draft: DraftSnapshot | None = None  # the draft model's memory (None: none)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["moe_expert_tokens"] = {str(k): v for k, v in self.moe_expert_tokens.items()}
        for pool in (d["device"], d["host"]):
            if pool is not None:
                pool["hashes"] = {str(k): v for k, v in pool["hashes"].items()}
                pool["texts"] = {str(k): v for k, v in pool["texts"].items()}
        return d


def pool_snapshot(pool: BlockPool, hidden: Iterable[int] = ()) -> PoolSnapshot:
    """The pool's states and ref counts; `hidden`: blocks whose hashes are not shown (opaque tenants). Costs a pass
    over the ref counts, and over the cached or the free blocks, whichever are fewer."""
    refs = np.asarray(pool.ref_counts, dtype=np.int64)
    states = np.where(refs > 0, USED, FREE)
    if len(pool.cached) <= pool.num_free:
        cached = np.fromiter(pool.cached.values(), dtype=np.int64, count=len(pool.cached))
        cached = cached[refs[cached] == 0]
    else:
        hashed = pool.block_hash
        cached = np.fromiter((b for b in pool.free_blocks if hashed[b] is not None), dtype=np.int64)
    states[cached] = CACHED
    hide = set(hidden)
    hashes: dict[int, str] = {}
    truncated = False
    for h, b in pool.cached.items():
        if b in hide:
            continue
        if len(hashes) == MAX_HASHES:
            truncated = True
            break
        hashes[b] = h[:4].hex()
    counts = np.bincount(states, minlength=3)
    return PoolSnapshot(pool.num_blocks, int(counts[FREE]), int(counts[USED]), int(counts[CACHED]),
                        run_lengths(states), run_lengths(refs), hashes, truncated)


def seq_tree(req: Request) -> list[tuple[Seq, int | None, int]]:
    """The request's live sequences in tree order (a parent before its children, siblings by sample index), each
    with its parent's seq_id (its nearest live ancestor; None: a root) and the tokens they share."""
    live = req.live_seqs
    if len(live) == 1 and live[0].parent_seq_id is None:  # most requests: one sequence, never forked
        return [(live[0], None, 0)]
    by_id = {s.seq_id: s for s in req.seqs}
    children: dict[int | None, list[tuple[Seq, int]]] = {}
    for seq in live:
        parent, at = by_id.get(seq.parent_seq_id), seq.forked_at
        while parent is not None and parent.status.finished:
            parent, at = by_id.get(parent.parent_seq_id), min(at, parent.forked_at)
        pid = parent.seq_id if parent is not None else None
        children.setdefault(pid, []).append((seq, at if pid is not None else 0))
    out: list[tuple[Seq, int | None, int]] = []
    stack: list[tuple[Seq, int | None, int]] = []

    def push(pid: int | None) -> None:
        stack.extend((s, pid, at) for s, at in sorted(children.get(pid, ()), key=lambda c: -c[0].index))

    push(None)
    while stack:
        seq, pid, at = stack.pop()
        out.append((seq, pid, at))
        push(seq.seq_id)
    return out


def seq_snapshots(requests: Iterable[tuple[str, Request]], bm: BlockManager, show_text: bool = False,
                  detokenize=None) -> list[SeqSnapshot]:
    """The live sequences of `requests` ((status, request) pairs) with their block tables, each request's as a tree
    (`seq_tree`)."""
    out = []
    for status, req in requests:
        for seq, parent, forked_at in seq_tree(req):
            tables = [list(t) for t in bm.block_tables.get(seq.seq_id, ())]
            opaque = req.cache_salt is not None
            text = None
            if show_text and not opaque and detokenize is not None:
                text = detokenize(seq.token_ids()[-MAX_TEXT_CHARS:])[-MAX_TEXT_CHARS:]
            out.append(SeqSnapshot(req.request_id, seq.index, seq.seq_id,
                                   "swapped" if seq.seq_id in bm.swapped else status, len(seq.prompt_token_ids),
                                   seq.num_tokens, seq.num_computed_tokens, req.num_cached_tokens, tables, opaque,
                                   text, parent, forked_at))
    return out


def block_texts(requests: Iterable[tuple[str, Request]], bm: BlockManager,
                decode_batch: Callable[[list[list[int]]], list[str]]) -> dict[int, str]:
    """Device block -> the text of the tokens whose K/V it holds, read from its first listed owner (none of opaque
    tenants' or swapped sequences' blocks); at most MAX_BLOCK_TEXTS blocks, decoded in one batch."""
    def token_runs() -> Iterator[tuple[int, list[int]]]:
        seen: set[int] = set()
        for _, req in requests:
            if req.cache_salt is not None:
                continue
            for seq in req.live_seqs:
                if seq.seq_id in bm.swapped:
                    continue
                n, size = seq.num_computed_tokens, bm.block_size
                for table in bm.block_tables.get(seq.seq_id, ()):
                    for j, b in enumerate(table[:-(-n // size)]):
                        if b >= 0 and b not in seen:
                            seen.add(b)
                            yield b, seq.token_slice(j * size, min(n, (j + 1) * size))

    runs = list(itertools.islice(token_runs(), MAX_BLOCK_TEXTS))
    return dict(zip((b for b, _ in runs), decode_batch([ids for _, ids in runs]))) if runs else {}


def host_rss() -> int | None:
    """This process's resident set size in bytes (None where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def build_snapshot(engine: LLMEngine, show_text: bool = False) -> EngineSnapshot:
    """The engine's memory state now. Engine thread only, between steps."""
    bm, sch = engine.block_manager, engine.scheduler
    requests = ([("running", r) for r in sch.running] + [("swapped", r) for r in sch.swapped]
                + [("waiting", r) for r in sch.waiting])
    tok = engine.tokenizer
    seqs = seq_snapshots(requests, bm, show_text, lambda ids: tok.decode(ids))
    hidden = {b for s in seqs if s.opaque and s.status != "swapped" for t in s.block_tables for b in t}
    device = pool_snapshot(bm.gpu, hidden)
    if show_text:
        device.texts = block_texts(requests, bm, lambda runs: tok.decode_batch(runs, skip_special_tokens=False))
    report, moves = engine.memory_report, engine.block_moves
    return EngineSnapshot(
        time=time.time(), block_size=bm.block_size, kv_dtype=report.dtype, num_groups=bm.num_groups,
        prefix_caching=bm.enable_prefix_caching, device=device,
        host=pool_snapshot(bm.cpu) if bm.cpu.num_blocks else None, seqs=seqs,
        queues=dict(running=len(sch.running), waiting=len(sch.waiting), swapped=len(sch.swapped),
                    running_seqs=sum(len(r.live_seqs) for r in sch.running)),
        counters=dict(preemptions=sch.num_preemptions, cow_blocks=moves.copied, swapped_out_blocks=moves.swapped_out,
                      swapped_in_blocks=moves.swapped_in, prefix_queries=bm.prefix_queries,
                      prefix_hits=bm.prefix_hits, prefix_evictions=bm.gpu.num_evicted,
                      prompt_tokens=sch.num_prompt_tokens, generation_tokens=sch.num_generation_tokens),
        memory=dict(weights=report.weight_bytes, kv_cache=report.kv_cache_bytes, per_block=report.bytes_per_block,
                    host_rss=host_rss()),
        moe_expert_tokens={i: m.expert_tokens.tolist() for i, m in engine.runner.moe_blocks},
        draft=draft_snapshot(engine))


def draft_snapshot(engine: LLMEngine) -> DraftSnapshot | None:
    """The draft model's memory: sizes from the engine's memory report, blocks from the draft's block manager."""
    drafter, report = engine.spec.drafter, engine.memory_report
    if drafter is None:
        return None
    bm = drafter.bm
    return DraftSnapshot(report.draft_model, report.draft_weight_bytes, report.draft_kv_cache_bytes,
                         report.draft_bytes_per_block, bm.num_total_blocks, bm.num_total_blocks - bm.num_free_blocks,
                         bm.num_free_blocks, drafter.num_seqs)
