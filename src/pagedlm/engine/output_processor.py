"""From sampled tokens to what callers see: incremental detokenization, stop checks (stop strings cut, and text
that could still become one held back), logprob decoding, and each request's `EngineOutput` delta. Holds no
scheduling state: it says when a sequence should finish (`check_stop` returns the status) and the scheduler
finishes it (`Scheduler.update_from_output`)."""
from __future__ import annotations

import torch

from pagedlm.engine.errors import EngineError
from pagedlm.engine.protocol import CompletionDelta, EngineOutput, FinishedRequestStats
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.outputs import PositionLogprobs
from pagedlm.sampling.detokenizer import IncrementalDetokenizer, find_stop, held_back
from pagedlm.sampling.sampler import prompt_logprobs


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def detokenizer(self, req: Request) -> IncrementalDetokenizer:
        """A fresh detokenizer for one sample of `req` (its text starts after the prompt)."""
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)

    def decode_logprobs(self, entry: PositionLogprobs) -> PositionLogprobs:
        for tid, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
        return entry

    def add_prompt_logprobs(self, req: Request, logits: torch.Tensor, first: int, end: int) -> None:
        """Record the logprobs of prompt tokens first + 1 .. end from the logits of positions first .. end - 1."""
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no logprob
        targets = req.prompt_token_ids[first + 1:end + 1]
        entries = prompt_logprobs(logits, targets, req.params.prompt_logprobs)
        req.prompt_logprobs.extend(self.decode_logprobs(e) for e in entries)

    def check_stop(self, req: Request, seq: Sequence, token: int) -> SequenceStatus | None:
        """Detokenize `token` (just appended to `seq`) and check the stop conditions: EOS, stop_token_ids and
        stop strings once min_tokens is met, then max_tokens and max_model_len. Returns the status the sequence
        finishes with, or None; cuts its unsent text at a stop string and sets its stop_reason.

        A stop string that ends in the new text starts in the text not sent yet: what was sent could not grow
        into a stop string (`make_output` holds such text back), so only `unsent_text` is searched."""
        params = req.params
        delta = seq.detokenizer.append(token)
        seq.unsent_text += delta
        n_out = len(seq.output_token_ids)
        status = None
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif params.stop and delta:
                hit = find_stop(seq.unsent_text, len(delta), params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    seq.unsent_text, seq.stop_reason = hit
                    status = SequenceStatus.FINISHED_STOPPED
        if status is None and ((params.max_tokens is not None and n_out >= params.max_tokens)
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None and (seq.stop_reason is None or isinstance(seq.stop_reason, int)):
            self.finish_text(seq)  # a stop string already cut the text
        return status

    def finish_text(self, seq: Sequence) -> None:
        """The sequence ends: release the text held back for an incomplete character."""
        seq.unsent_text += seq.detokenizer.flush()

    def beam_outputs(self, req: Request) -> list[CompletionDelta]:
        """The `n` best hypotheses of a finished beam search, whole."""
        return [CompletionDelta(k, h.token_ids, self.tokenizer.decode(h.token_ids, req.params.skip_special_tokens),
                                None, h.logprob, "stop" if h.eos else "length")
                for k, h in enumerate(req.beam.best(req.params.n))]

    def make_output(self, req: Request, finished: bool, error: EngineError | None = None) -> EngineOutput | None:
        """What `req` has new since its last output (None: nothing). The first output carries the prompt; a
        beam search sends its hypotheses once it is done; a finished request's output carries its stats."""
        first = not req.output_started
        out = EngineOutput(req.request_id, self._beam_deltas(req, finished) if req.beam is not None
                           else self._deltas(req), finished, metrics=req.metrics, error=error)
        if first:
            req.output_started = True
            out.prompt_token_ids, out.prompt, out.num_cached_tokens = req.prompt_token_ids, req.prompt, \
                req.num_cached_tokens
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs = req.prompt_logprobs or [None]
        if finished:
            out.stats = self._stats(req)
            if req.pooler is not None:
                out.embedding = req.pooler.embedding
        elif not first and not out.outputs:
            return None
        return out

    def _deltas(self, req: Request) -> list[CompletionDelta]:
        deltas = []
        stops, want_logprobs = req.params.stop, req.params.logprobs is not None
        for seq in req.seqs:
            if seq.finish_sent:
                continue
            done = seq.status.finished
            tokens = seq.output_token_ids[seq.num_sent_tokens:]
            text = seq.unsent_text
            keep = held_back(text, stops) if stops and not done else 0
            if not tokens and len(text) == keep and not done:
                continue
            seq.unsent_text = text[len(text) - keep:] if keep else ""
            seq.num_sent_tokens += len(tokens)
            logprobs = None
            if want_logprobs:
                logprobs, seq.unsent_logprobs = seq.unsent_logprobs, []
            deltas.append(CompletionDelta(seq.index, tokens, text[:len(text) - keep], logprobs,
                                          seq.cumulative_logprob, seq.status.finish_reason, seq.stop_reason if done
                                          else None))
            seq.finish_sent = done
        return deltas

    def _beam_deltas(self, req: Request, finished: bool) -> list[CompletionDelta]:
        if req.beam_outputs is not None:
            deltas, req.beam_outputs = req.beam_outputs, []
            return deltas
        return [CompletionDelta(k, finish_reason="abort") for k in range(req.params.n)] if finished else []

    @staticmethod
    def _stats(req: Request) -> FinishedRequestStats:
        if req.beam is not None and req.beam.done:
            best = req.beam.best(req.params.n)
            generated, reasons = sum(len(h.token_ids) for h in best), ["stop" if h.eos else "length" for h in best]
        else:
            generated = sum(len(s.output_token_ids) for s in req.seqs)
            reasons = [s.status.finish_reason or "abort" for s in sorted(req.seqs, key=lambda s: s.index)]
        return FinishedRequestStats(req.request_id, len(req.prompt_token_ids), generated, reasons, req.metrics)
