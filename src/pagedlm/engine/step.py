"""One engine step's types: the model input built from the scheduler's output (`StepBatch`, `build_batch`), the
logits rows it reads back (`SampleRow`, `PromptLogprobRow`) and `StepContext`, what the step learns on its way
(requests that failed, sequences that ended, requests with news, grammar masks). A context lives for one step:
nothing of it is left on the engine between steps."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedlm.engine.errors import EngineError
from pagedlm.engine.model_runner import Chunk
from pagedlm.engine.scheduler import FinishedSeq, ScheduledSeq, SchedulerOutput
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.sampling.structured import PendingMasks


@dataclass
class SampleRow:
    """A scheduled chunk that completes its sequence: the next token is sampled from logits row `index`; with
    `draft_token_ids` (speculative decoding), rows index + 1 .. index + len(draft) follow each draft token."""

    sched: ScheduledSeq
    index: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def request(self) -> Request:
        return self.sched.request

    @property
    def seq(self) -> Sequence:
        return self.sched.seq


@dataclass
class PromptLogprobRow:
    """Prompt positions first .. end - 1 computed in this step, at logits rows index .. index + end - first - 1:
    they give the logprobs of prompt tokens first + 1 .. end."""

    sched: ScheduledSeq
    index: int
    first: int
    end: int

    @property
    def request(self) -> Request:
        return self.sched.request

    @property
    def rows(self) -> slice:
        return slice(self.index, self.index + self.end - self.first)


class PoolRow(PromptLogprobRow):
    """Prompt positions first .. end - 1 of a pooling request computed in this step, at hidden-state rows
    index .. index + end - first - 1 (engine/pooling.py)."""


@dataclass
class StepBatch:
    """One step's model input (a chunk per scheduled sequence), the logits rows it reads back and the final
    hidden-state rows (pooling requests')."""

    chunks: list[Chunk] = field(default_factory=list)
    logits_index: list[int] = field(default_factory=list)  # positions in the flat batch whose logits come back
    prompt_logprobs: list[PromptLogprobRow] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    hidden_index: list[int] = field(default_factory=list)  # positions whose final hidden states come back
    pools: list[PoolRow] = field(default_factory=list)


def build_batch(sched: SchedulerOutput, block_manager: BlockManager) -> StepBatch:
    """The flat batch of the scheduled chunks, and the logits rows the step needs: prompt logprobs of the prompt
    positions computed now, and one row per chunk that completes its sequence (to sample from); a pooling
    request's chunk reads hidden states instead: every position not pooled yet (mean), or the last one once its
    chunk completes the prompt (last)."""
    batch = StepBatch()
    offset = 0
    for s in sched.scheduled:
        req, start = s.request, s.start
        real = s.num_new_tokens - s.num_draft_tokens
        drafts = s.seq.draft_token_ids[:s.num_draft_tokens]
        batch.chunks.append(Chunk(s.seq.token_slice(start, start + real) + drafts, start,
                                  block_manager.get_block_tables(s.seq)))
        if req.wants_prompt_logprobs and start < len(req.prompt_token_ids):
            first = max(start, len(req.prompt_logprobs) - 1 if req.prompt_logprobs else 0)
            end = min(start + s.num_new_tokens, len(req.prompt_token_ids) - 1)
            if end > first:
                batch.prompt_logprobs.append(PromptLogprobRow(s, len(batch.logits_index), first, end))
                batch.logits_index.extend(range(offset + first - start, offset + end - start))
        if req.pooler is not None:
            end = start + real
            first = max(start, req.pooler.num_pooled) if req.pooler.every_position else end - 1
            if end > first and (s.completes or req.pooler.every_position):
                batch.pools.append(PoolRow(s, len(batch.hidden_index), first, end))
                batch.hidden_index.extend(range(offset + first - start, offset + end - start))
        elif s.completes:
            batch.samples.append(SampleRow(s, len(batch.logits_index), drafts))
            batch.logits_index.extend(range(offset + real - 1, offset + s.num_new_tokens))
        offset += s.num_new_tokens
    return batch


@dataclass
class StepContext:
    """What one step learns: `failed` requests (their error; the rest of the batch goes on), sequences that
    `finished` (the scheduler frees them in `update_from_output`), `touched` requests (with news for an output),
    tokens generated, and the grammar masks started before the forward pass."""

    sched: SchedulerOutput
    batch: StepBatch
    failed: dict[str, tuple[Request, EngineError]] = field(default_factory=dict)
    finished: list[FinishedSeq] = field(default_factory=list)
    touched: dict[str, Request] = field(default_factory=dict)
    num_generated_tokens: int = 0
    masks: PendingMasks | None = None
    mask_errors: list[tuple[Request, Exception]] = field(default_factory=list)
    now: float = field(default_factory=time.monotonic)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """`seq` ends with `status` at the end of this step."""
        self.finished.append(FinishedSeq(seq, status))

    def token_generated(self, req: Request, count: int = 1) -> None:
        """`req` got `count` tokens now (its first and latest token times)."""
        self.num_generated_tokens += count
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = self.now
        req.metrics.last_token_time = self.now
        self.touched[req.request_id] = req
