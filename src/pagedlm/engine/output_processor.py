"""From sampled tokens to what callers see: incremental detokenization, stop checks, logprob decoding and
`RequestOutput`s. Holds no scheduling state: it says when a sequence should finish (`check_stop` returns the
status) and the scheduler finishes it (`Scheduler.update_from_output`)."""
from __future__ import annotations

import torch

from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedlm.sampling.detokenizer import IncrementalDetokenizer, find_stop
from pagedlm.sampling.sampler import prompt_logprobs


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def detokenizer(self, req: Request) -> IncrementalDetokenizer:
        """A fresh detokenizer for one sample of `req` (its text starts after the prompt)."""
        return IncrementalDetokenizer(self.tokenizer.hf, req.prompt_token_ids, req.params.skip_special_tokens)

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
        finishes with, or None; sets its text (cut at a stop string) and stop_reason."""
        params = req.params
        delta = seq.detokenizer.append(token)
        seq.output_text = seq.detokenizer.text
        n_out = len(seq.output_token_ids)
        status = None
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in params.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif params.stop and delta:
                hit = find_stop(seq.output_text, len(delta), params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    seq.output_text, seq.stop_reason = hit
                    status = SequenceStatus.FINISHED_STOPPED
        if status is None and ((params.max_tokens is not None and n_out >= params.max_tokens)
                               or seq.num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None and (seq.stop_reason is None or isinstance(seq.stop_reason, int)):
            self.finish_text(seq)  # a stop string already cut the text
        return status

    def finish_text(self, seq: Sequence) -> None:
        """The sequence ends: release the text held back for an incomplete character."""
        seq.detokenizer.flush()
        seq.output_text = seq.detokenizer.text

    def beam_outputs(self, req: Request) -> list[CompletionOutput]:
        """The `n` best hypotheses of a finished beam search."""
        return [CompletionOutput(index=k, text=self.tokenizer.decode(h.token_ids, req.params.skip_special_tokens),
                                 token_ids=h.token_ids, cumulative_logprob=h.logprob,
                                 finish_reason="stop" if h.eos else "length")
                for k, h in enumerate(req.beam.best(req.params.n))]

    def request_output(self, req: Request, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=req.beam_outputs if req.beam_outputs is not None else
            [s.to_output() for s in sorted(req.seqs, key=lambda s: s.index)], finished=finished,
            prompt_logprobs=(req.prompt_logprobs or [None]) if req.params.prompt_logprobs is not None else None,
            metrics=req.metrics, num_cached_tokens=req.num_cached_tokens)
