"""A step's tokens, from its logits: prompt logprobs recorded, the `n` samples of a request forked after its
prefill, beam searches advanced (sampling/beam_search.py), the other rows sampled in one batch with their grammar
masks (started before the forward pass, sampling/structured.py), and each token appended and checked for a stop.
A request that fails any of this fails alone (`fail`): the rest of the batch goes on."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedlm.engine.errors import ConstraintError, EngineError, failed
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.engine.scheduler import Scheduler
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.engine.step import SampleRow, StepContext
from pagedlm.outputs import PositionLogprobs
from pagedlm.sampling.beam_search import plan_beam_step
from pagedlm.sampling.sampler import Sampler, SamplingRow
from pagedlm.sampling.structured import MaskPrefetcher, StructuredOutputError, StructuredOutputManager

logger = logging.getLogger(__name__)


class StepSampler:
    """Turns one step's logits into tokens on its requests' sequences (`sample`). `new_seq(req, index)` makes a
    request's sample `index` (the engine's: its generator and detokenizer)."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler, output_processor: OutputProcessor,
                 masks: MaskPrefetcher, new_seq: Callable[[Request, int], Sequence]) -> None:
        self.scheduler, self.bm = scheduler, scheduler.block_manager
        self.sampler, self.output_processor, self.masks = sampler, output_processor, masks
        self.new_seq = new_seq

    @property
    def structured(self) -> StructuredOutputManager:
        return self.masks.manager()

    # --- before the forward pass --------------------------------------------------------------------------
    def start_masks(self, ctx: StepContext) -> None:
        """Start the grammar masks of the sequences this step samples for, on the mask thread, so that they
        overlap the forward pass, with a mask per draft position of a speculating sequence (its grammar state after
        the drafts before it). Sequences without a matcher yet get one (fresh, replayed over their output)."""
        matchers = {}
        for row in ctx.batch.samples:
            p = row.request.params
            if p.structured_outputs is None or p.max_tokens == 0 or row.request.beam is not None:
                continue
            try:
                if row.seq.matcher is None:
                    row.seq.matcher = self.structured.replay(p._grammar, row.seq.output_token_ids)
                matchers[row.seq.seq_id] = (row.seq.matcher, row.draft_token_ids)
            except Exception as e:  # noqa: BLE001 - isolate the request (failed once the batch has run)
                ctx.mask_errors.append((row.request, e))
        ctx.masks = self.masks.start(matchers)

    # --- after it ---------------------------------------------------------------------------------------
    def sample(self, ctx: StepContext, logits: torch.Tensor) -> None:
        for req, e in ctx.mask_errors:
            self.fail(ctx, req, e)
        for row in ctx.batch.prompt_logprobs:
            try:
                self.output_processor.add_prompt_logprobs(row.request, logits[row.rows], row.first, row.end)
            except Exception as e:  # noqa: BLE001 - isolate the request
                self.fail(ctx, row.request, e)
        rows, targets, index, positions = [], [], [], []
        drafted: dict[int, SampleRow] = {}  # first of a drafted sequence's rows in `targets` -> its SampleRow
        beams: dict[str, list[SampleRow]] = {}
        for row in ctx.batch.samples:
            req = row.request
            if req.request_id in ctx.failed:
                continue
            if req.beam is not None:
                beams.setdefault(req.request_id, []).append(row)
                continue
            try:
                seqs = self._fork_samples(req, row.seq)
            except Exception as e:  # noqa: BLE001 - isolate the request
                self.fail(ctx, req, e)
                continue
            if req.params.max_tokens == 0:  # scoring only (echo + prompt_logprobs): every sample ends empty
                for seq in seqs:
                    self.output_processor.finish_text(seq)
                    ctx.finish(seq, SequenceStatus.FINISHED_LENGTH)
                ctx.touched[req.request_id] = req
                continue
            for seq in seqs:
                drafts = row.draft_token_ids if seq is row.seq else []
                if drafts:
                    drafted[len(targets)] = row
                for j in range(len(drafts) + 1):  # the token after each accepted draft prefix
                    out = seq.output_token_ids + drafts[:j] if j else seq.output_token_ids
                    rows.append(SamplingRow(req.params, req.prompt_token_ids, out, seq.generator,
                                            thinking=seq.thinking))
                    targets.append((req, seq))
                    index.append(row.index + j)
                    positions.append(j)
        self._fill_masks(ctx, rows, targets, positions)
        for beam_rows in beams.values():
            req = beam_rows[0].request
            try:
                self._beam_step(ctx, req, beam_rows, logits)
            except Exception as e:  # noqa: BLE001 - isolate the request
                self.fail(ctx, req, e)
        if not rows:
            return
        if index != list(range(logits.shape[0])):  # else every row once, in order: no copy of the logits
            logits = logits[index]
        tokens, chosen, top = self._sample_rows(ctx, logits, rows, targets)
        k = 0
        while k < len(targets):
            req, seq = targets[k]
            draft = drafted.get(k)
            width = 1 + (len(draft.draft_token_ids) if draft is not None else 0)
            if req.request_id not in ctx.failed:
                try:
                    if draft is None:
                        self._append_token(ctx, req, seq, tokens[k], chosen[k], top[k])
                    else:
                        self._append_verified(ctx, draft, tokens[k:k + width], chosen[k:k + width], top[k:k + width])
                except Exception as e:  # noqa: BLE001 - isolate the request
                    self.fail(ctx, req, e)
            k += width

    def fail(self, ctx: StepContext, req: Request, error: Exception) -> None:
        """End one request of the step with an error (its blocks freed); the other requests go on."""
        if req.request_id in ctx.failed:
            return
        if isinstance(error, StructuredOutputError):  # the client's constraint, at a limit of the grammar engine
            logger.warning("Request %s: %s", req.request_id, error)
            self.structured.forget(req.params.structured_outputs)  # its template may hold the failed state
            reason: EngineError = ConstraintError(f"Request {req.request_id}: {error}")
        else:
            logger.error("Request %s failed (%s: %s); the rest of the batch goes on", req.request_id,
                         type(error).__name__, error, exc_info=error)
            reason = failed(req.request_id, error)
        self.scheduler.finish(ctx.finished)  # its samples that ended before it failed keep their finish reason
        ctx.finished.clear()
        self.scheduler.abort_request(req.request_id)
        ctx.failed[req.request_id] = (req, reason)

    def _fork(self, req: Request, parent: Sequence) -> Sequence:
        """A new sample of `req` that continues `parent`: its tokens, score and grammar state, sharing all its
        KV blocks (copied on write). Forks the `n` samples after the prefill, and beams chosen twice. The parent
        was sampled for in this step, so all its tokens are computed once the step is done, and the child's too.
        Its index is new in the request (beams drop their ended sequences: their count would repeat one)."""
        child = self.new_seq(req, max(s.index for s in req.seqs) + 1)
        child.output_token_ids = list(parent.output_token_ids)
        child.cumulative_logprob = parent.cumulative_logprob
        child.num_computed_tokens = parent.num_tokens
        child.status = SequenceStatus.RUNNING
        child.parent_seq_id, child.forked_at = parent.seq_id, parent.num_tokens
        if parent.matcher is not None:
            child.matcher = parent.matcher.deep_copy()
        if parent.thinking is not None:
            child.thinking = parent.thinking.copy()
        self.bm.fork(parent, child)
        req.seqs.append(child)
        return child

    def _fork_samples(self, req: Request, seq: Sequence) -> list[Sequence]:
        """The sequences a request samples for: its first sample fans out into `n`."""
        if req.forked:
            return [seq]
        req.forked = True
        return [seq] + [self._fork(req, seq) for _ in range(1, req.params.n)]

    def _fill_masks(self, ctx: StepContext, rows: list[SamplingRow], targets: list[tuple[Request, Sequence]],
                    positions: list[int]) -> None:
        """Each constrained row's grammar bitmask (row k follows positions[k] draft tokens): from the masks started
        before the forward pass, plus (in one call) those of sequences forked in this step."""
        late = []
        for k, (_, seq) in enumerate(targets):
            bitmask = ctx.masks.get(seq.seq_id, positions[k]) if ctx.masks is not None else None
            if bitmask is not None:
                rows[k].bitmask = bitmask
            elif seq.matcher is not None:
                late.append(k)
        if late:
            extra = self.masks.fill([targets[k][1].matcher for k in late])
            for j, k in enumerate(late):
                rows[k].bitmask = extra[j]

    def _sample_rows(self, ctx: StepContext, logits: torch.Tensor, rows: list[SamplingRow],
                     targets: list[tuple[Request, Sequence]]) -> tuple[list, list, list]:
        """The sampler over the whole batch; if it raises, again per request, so that only the requests it
        fails for fail (their rows come back as None)."""
        try:
            out = self.sampler(logits, rows)
            return out.token_ids, out.logprobs, out.top_logprobs
        except Exception:  # noqa: BLE001 - find the culprit below
            logger.warning("Batched sampling failed; sampling request by request", exc_info=True)
        tokens, logprobs, top = [None] * len(rows), [None] * len(rows), [None] * len(rows)
        groups: dict[str, list[int]] = {}
        for k, (req, _) in enumerate(targets):
            groups.setdefault(req.request_id, []).append(k)
        for ks in groups.values():
            req = targets[ks[0]][0]
            try:
                out = self.sampler(logits[ks], [rows[k] for k in ks])
            except Exception as e:  # noqa: BLE001 - isolate the request
                self.fail(ctx, req, e)
                continue
            for j, k in enumerate(ks):
                tokens[k], logprobs[k], top[k] = out.token_ids[j], out.logprobs[j], out.top_logprobs[j]
        return tokens, logprobs, top

    def _append_verified(self, ctx: StepContext, row: SampleRow, tokens: list[int], logprobs: list[float],
                         top: list[PositionLogprobs | None]) -> None:
        """Speculative decoding's verification. tokens[j] was sampled from the target distribution after the
        sequence and drafts[:j]: it is appended, and while it equals drafts[j] the next one is too (at most
        len(drafts) + 1 tokens: the last is the correction, or the bonus after a fully accepted draft).

        Lossless: a draft token x is accepted exactly when the target's own sample at its position is x, so the
        appended token has the target's distribution there, p(x) for x and p(y) for every y != x. That is rejection
        sampling (accept x with probability min(1, p(x)/q(x)), else sample from max(0, p - q)) for a draft q that
        is certain of x, as n-gram and predicted drafts are; greedy requests get the argmax at every position.
        A constrained sequence's rows carry the grammar's mask after the drafts before them, and its matcher
        consumes only the appended tokens: it never holds a rejected draft."""
        req, seq, drafts = row.request, row.seq, row.draft_token_ids
        appended = 0
        for j, token in enumerate(tokens):
            appended += 1
            if self._append_token(ctx, req, seq, token, logprobs[j], top[j]) or j == len(drafts) \
                    or token != drafts[j]:
                break
        accepted = appended - 1  # drafts whose K/V the step wrote and the sequence kept
        row.sched.num_accepted_tokens = accepted
        seq.spec.record(len(drafts), accepted)
        req.metrics.spec_draft_tokens += len(drafts)
        req.metrics.spec_accepted_tokens += accepted

    def _append_token(self, ctx: StepContext, req: Request, seq: Sequence, token: int, logprob: float,
                      top: PositionLogprobs | None) -> bool:
        """Append `token` to `seq`; True if the sequence ends with it."""
        # an llguidance matcher stopped by a limit allows and accepts only EOS: is_error tells it from an end
        if seq.matcher is not None and (not seq.matcher.consume_token(token) or seq.matcher.is_error()):
            error = (seq.matcher.get_error() or "").strip().splitlines()
            raise StructuredOutputError(f"The constraint stopped at output token {len(seq.output_token_ids)}: "
                                        f"{error[0] if error else token}")
        seq.output_token_ids.append(token)
        if seq.thinking is not None:
            seq.thinking.advance(req.params, seq.output_token_ids)
        seq.cumulative_logprob += logprob
        if top is not None:
            seq.unsent_logprobs.append(self.output_processor.decode_logprobs(top))
        ctx.token_generated(req)
        status = self.output_processor.check_stop(req, seq, token)
        if status is None and seq.matcher is not None and seq.matcher.is_stopped():
            self.output_processor.finish_text(seq)  # the grammar allows nothing more
            status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            ctx.finish(seq, status)
        return status is not None

    def _beam_step(self, ctx: StepContext, req: Request, rows: list[SampleRow], logits: torch.Tensor) -> None:
        """Advance a beam search by one token: the chosen continuations reuse their parent's sequence, or fork it
        (sharing all its blocks) when a parent is chosen twice; unchosen beams finish (freeing their blocks)."""
        parents = [row.seq for row in rows]
        step = plan_beam_step(req.beam, logits[[row.index for row in rows]],
                              [p.cumulative_logprob for p in parents], [p.output_token_ids for p in parents])
        ctx.token_generated(req, len(parents))
        targets = [(self._fork(req, parents[i]) if forked else parents[i], cand)
                   for i, cand, forked in step.continued]
        for i in step.ended:
            ctx.finish(parents[i], SequenceStatus.FINISHED_STOPPED)
        for seq, cand in targets:
            seq.output_token_ids.append(cand.token)
            seq.cumulative_logprob = cand.logprob
        req.keep_seqs([seq for seq, _ in targets] or parents)
        if req.beam.done:  # nothing was chosen: every beam finished above
            req.beam_outputs = self.output_processor.beam_outputs(req)
