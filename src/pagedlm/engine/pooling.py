"""Embeddings of a generation model: a pooling request (`EngineRequest.pooling`) is prefilled like any prompt,
chunked, batched with the other requests and sharing their steps, but reads back the final hidden states of its
positions (after the model's final norm) instead of logits, and ends when its prompt is computed, with its vector.

`PoolingState` folds a request's hidden rows into that vector as its chunks are computed: mean pooling sums every
position once (a recomputed chunk after preemption skips the positions already summed, and the scheduler never
reuses cached prefix blocks for it, whose positions it would not see); last pooling keeps the last position's row,
which the step that completes the prompt always computes (a prefix cache hit never covers the last token).
Nothing pooling computes goes into the KV cache but the prompt's own K/V, the same as a generation request with
that prompt writes, so the prefix cache stays right."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from pagedlm.engine.protocol import PoolingParams
from pagedlm.engine.sequence import Request, SequenceStatus

if TYPE_CHECKING:
    from pagedlm.engine.step import StepContext


class PoolingState:
    """One pooling request's vector, built over its prompt's positions (`add`) and finished once all are in."""

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.num_pooled = 0  # prompt positions folded in (mean), or the last one seen + 1 (last)
        self._acc: torch.Tensor | None = None  # float32: the sum of the rows (mean), the last row (last)
        self.embedding: list[float] | None = None

    @property
    def every_position(self) -> bool:
        """Whether every prompt position's hidden state counts (mean), not the last one's only."""
        return self.params.pooling == "mean"

    def add(self, rows: torch.Tensor, first: int, end: int) -> None:
        """The final hidden states [end - first, hidden] of prompt positions first .. end - 1."""
        rows = rows.float()
        if self.every_position:
            part = rows.sum(0)
            self._acc = part if self._acc is None else self._acc + part
        else:
            self._acc = rows[-1].clone()
        self.num_pooled = end

    def finish(self, num_positions: int) -> list[float]:
        """The vector, once all `num_positions` prompt positions are in."""
        v = self._acc / num_positions if self.every_position else self._acc
        if self.params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        self.embedding = v.tolist()
        return self.embedding


def pool_step(ctx: StepContext, hidden: torch.Tensor | None,
              fail: Callable[[StepContext, Request, Exception], None]) -> None:
    """The step's hidden rows (`ctx.batch.pools`) folded into their requests; a request whose prompt is now
    computed finishes with its vector. `fail(ctx, req, error)` ends a request that fails here alone."""
    for row in ctx.batch.pools:
        req = row.request
        if req.request_id in ctx.failed:
            continue
        try:
            req.pooler.add(hidden[row.rows], row.first, row.end)
            if row.sched.completes:
                req.pooler.finish(len(req.prompt_token_ids))
                ctx.finish(row.sched.seq, SequenceStatus.FINISHED_STOPPED)
                ctx.touched[req.request_id] = req
        except Exception as e:  # noqa: BLE001 - isolate the request
            fail(ctx, req, e)
