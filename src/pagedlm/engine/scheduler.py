"""Iteration-level scheduler: decides, every step, which sequences run and how many tokens each computes.

Each step first serves running requests (decode tokens, or the next chunk of a prompt still being
prefilled), then swapped-out ones, then waiting ones, all under one token budget. When the KV cache has
no room for a running sequence's next tokens, the lowest-priority running request is preempted (recompute:
its blocks are freed and it is prefilled again later; swap: its blocks move to host memory). Blocks of
sliding-window layers are freed as soon as they leave the window (BlockManager.free_skipped_blocks).
After the step, `update_from_output` does the step's accounting: the scheduled tokens are computed, the prompt
and generated tokens counted, and the sequences that ended finish and free their blocks.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from pagedlm.config import EngineConfig
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.kvcache.block_manager import BlockManager


@dataclass
class ScheduledSeq:
    """Tokens start .. start + num_new_tokens of `seq` are computed in this step; the last `num_draft_tokens` of
    them are draft tokens (speculative decoding), of which verification accepts `num_accepted_tokens`."""

    request: Request
    seq: Sequence
    num_new_tokens: int
    start: int = -1  # the sequence's computed tokens when it was scheduled
    num_draft_tokens: int = -1
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_computed_tokens
        if self.num_draft_tokens < 0:
            self.num_draft_tokens = max(0, self.start + self.num_new_tokens - self.seq.num_tokens)

    @property
    def completes(self) -> bool:
        """This chunk reaches the end of the sequence's tokens, so a new token is sampled after it."""
        return self.start + self.num_new_tokens - self.num_draft_tokens == self.seq.num_tokens

    @property
    def num_computed_after(self) -> int:
        """The sequence's computed tokens once the step ran: its chunk, less the draft tokens rejected."""
        return self.start + self.num_new_tokens - self.num_draft_tokens + self.num_accepted_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)  # scheduled for the first time

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class FinishedSeq:
    """A sequence that ended in this step, and how."""

    seq: Sequence
    status: SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.loading: list[Request] = []  # waiting for their prefix to load from disk (kv_loader)
        self.kv_loader = None  # a DiskOffload (kv_offload.py): defer(request, hits) -> bool, ready() -> requests
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompts of the requests started (each counted once)
        self.num_generation_tokens = 0

    # --- queue management ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Remove the request wherever it is and free its blocks; returns it, or None if unknown."""
        for queue in (self.waiting, self.running, self.swapped, self.loading):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    for seq in req.seqs:
                        if not seq.status.finished:
                            seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq)
                    return req
        return None

    def update_from_output(self, out: SchedulerOutput, finished: Iterable[FinishedSeq],
                           num_generated_tokens: int) -> None:
        """The step `out` scheduled ran: its chunks are computed, the prompts it started and the tokens it
        generated are counted, and its ended sequences finish."""
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.num_computed_after
            if s.num_draft_tokens:  # the rejected drafts' slots go back
                self.block_manager.truncate(s.seq, s.seq.num_computed_tokens)
        self.num_prompt_tokens += sum(len(r.prompt_token_ids) for r in out.started)
        self.num_generation_tokens += num_generated_tokens
        self.finish(finished)

    def finish(self, finished: Iterable[FinishedSeq]) -> None:
        """The ended sequences take their final status and free their blocks; requests with no live sequence left
        leave the running queue. A sequence that finished already (its request aborted in the same step, or listed
        twice) is left as it is."""
        for f in finished:
            if f.seq.status.finished:
                continue
            f.seq.status = f.status
            self.block_manager.free(f.seq)
        self.running = [r for r in self.running if not r.finished]

    def step_failed(self, out: SchedulerOutput) -> None:
        """The step `out` scheduled did not complete (its forward pass raised): none of the KV it was to write
        is served from the prefix cache. Its requests stay where they are (the caller aborts or retries them)."""
        for s in out.scheduled:
            self.block_manager.uncommit(s.seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seqs_reserved for r in self.running)

    def _order(self, reqs) -> list[Request]:
        if self.config.scheduling_policy == "priority":
            return sorted(reqs, key=lambda r: (r.priority, r.arrival_time))
        return list(reqs)

    # --- the step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 0. Sliding-window blocks that left the window in the last step go back to the pool.
        if bm.has_sliding:
            for req in self.running:
                for seq in req.live_seqs:
                    bm.free_skipped_blocks(seq)

        # 1. Running requests, highest priority first; preempt from the back when blocks run out.
        queue = self._order(self.running)
        kept: list[Request] = []
        while queue:
            req = queue.pop(0)
            seqs, nums, budget = self._chunk(req, budget)
            if not seqs:
                kept.append(req)
                continue
            fits = bm.can_append_slots(seqs, nums)
            if not fits:  # draft tokens never preempt anyone: they wait
                real = [min(n, s.num_uncomputed_tokens) for s, n in zip(seqs, nums)]
                budget, nums = budget + sum(nums) - sum(real), real
                fits = bm.can_append_slots(seqs, nums)
            while not fits:
                victim = queue.pop() if queue else req
                self._preempt(victim, out)
                if victim is req:
                    break
                fits = bm.can_append_slots(seqs, nums)
            else:
                for seq, n in zip(seqs, nums):
                    out.blocks_to_copy += bm.append_slots(seq, n)
                    out.scheduled.append(ScheduledSeq(req, seq, n))
                    bm.commit(seq, min(seq.num_computed_tokens + n, seq.num_tokens))  # drafts are not cached
                kept.append(req)
                continue
            budget += sum(nums)  # req itself was preempted
        self.running = kept

        if out.preempted:
            return out

        # 2. Swapped-out requests come back before new ones start.
        for req in self._order(self.swapped):
            if budget <= 0 or self.num_running_seqs + req.num_seqs_reserved > self.config.max_num_seqs:
                break
            seqs, nums, new_budget = self._chunk(req, budget)
            if not seqs or len(seqs) < len(req.live_seqs) or not bm.can_swap_in(req.live_seqs, nums):
                break
            budget = new_budget
            out.blocks_to_swap_in += bm.swap_in(req.live_seqs)
            for seq, n in zip(seqs, nums):
                seq.status = SequenceStatus.RUNNING
                out.blocks_to_copy += bm.append_slots(seq, n)
                out.scheduled.append(ScheduledSeq(req, seq, n))
                bm.commit(seq, seq.num_computed_tokens + n)
            self.swapped.remove(req)
            self.running.append(req)
        if self.swapped:
            return out

        # 3. Waiting requests start (or restart after recompute), chunked under the budget.
        if self.kv_loader is not None:  # loaded prefixes are in the prefix cache now: those requests go first
            for req in reversed(self.kv_loader.ready()):
                self.loading.remove(req)
                self.waiting.appendleft(req)
        if self.config.scheduling_policy == "priority":
            self.waiting = deque(self._order(self.waiting))
        hit_cap: dict[int, int] = {}  # seq id -> cached blocks reused, for a prefix too big to revive at once
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if self.num_running_seqs + req.num_seqs_reserved > self.config.max_num_seqs:
                break
            hits = {s.seq_id: [] if req.reads_every_position else bm.find_cached_prefix(s)[:hit_cap.get(s.seq_id)]
                    for s in req.live_seqs}
            if self.kv_loader is not None and self.kv_loader.defer(req, hits):
                self.loading.append(self.waiting.popleft())
                continue
            skip = {sid: len(blocks) * bm.block_size for sid, blocks in hits.items()}
            seqs, nums, new_budget = self._chunk(req, budget, skip)
            if not seqs:
                break
            if not self.config.enable_chunked_prefill and any(
                    n < s.num_uncomputed_tokens - skip[s.seq_id] for s, n in zip(seqs, nums)):
                break
            if not bm.can_allocate(seqs, nums, [hits[s.seq_id] for s in seqs]):
                if self.running or not any(hits.values()):
                    break
                # Nothing runs, so nothing will free blocks: the cached prefix (revived all at once) and the chunk
                # cannot fit beside the watermark. Reuse half of it and recompute the rest.
                hit_cap.update({sid: len(h) // 2 for sid, h in hits.items()})
                continue
            budget = new_budget
            self.waiting.popleft()
            for seq, n in zip(seqs, nums):
                seq.status = SequenceStatus.RUNNING
                seq.num_computed_tokens = skip[seq.seq_id]
                req.num_cached_tokens = max(req.num_cached_tokens, skip[seq.seq_id])
                out.blocks_to_copy += bm.allocate(seq, n, hits[seq.seq_id])
                out.scheduled.append(ScheduledSeq(req, seq, n))
                bm.commit(seq, seq.num_computed_tokens + n)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                out.started.append(req)
            self.running.append(req)
        return out

    def _chunk(self, req: Request, budget: int,
               skip: dict[int, int] | None = None) -> tuple[list[Sequence], list[int], int]:
        """How many tokens each live sequence of `req` computes this step, within the budget
        (`skip`: tokens of a sequence already in the prefix cache)."""
        skip = skip or {}
        need = {s.seq_id: s.num_uncomputed_tokens - skip.get(s.seq_id, 0) for s in req.live_seqs}
        if req.beam is not None and sum(need.values()) > budget:
            # beams are scored together: hold back every beam's last token until all can complete at once
            need = {sid: n - 1 for sid, n in need.items()}
        seqs, nums = [], []
        left = budget
        for seq in req.live_seqs:
            n = min(need[seq.seq_id], left)
            if n <= 0:
                continue
            if n == 1 and seq.status is SequenceStatus.RUNNING:  # a decode: its draft tokens ride along
                n += min(len(seq.draft_token_ids), left - 1)
            seqs.append(seq)
            nums.append(n)
            left -= n
        return seqs, nums, left

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        req.metrics.num_preemptions += 1
        out.preempted.append(req)
        live = req.live_seqs
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(live):
            out.blocks_to_swap_out += self.block_manager.swap_out(live)
            for seq in live:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(req)
            self.swapped.sort(key=lambda r: r.arrival_time)
            return
        for seq in live:
            self.block_manager.free(seq)
            seq.reset_for_recompute()
        self.waiting.appendleft(req)
