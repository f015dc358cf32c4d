"""Logprobs in OpenAI's shapes, from the engine's (`PositionLogprobs`: token id -> logprob, rank, decoded text): a
completion's (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`, built up as deltas arrive), a chat answer's
(`content`, each token with its bytes, exact where it holds part of a character, and its top k by rank) and the
prompt's (vLLM's `prompt_logprobs`); a streamed answer's tokens, each with the chunk that carries its text
(`TextTokens`). -inf and NaN become -9999.0 (JSON has neither)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pagedlm.outputs import PositionLogprobs, RequestOutput
from pagedlm.sampling.detokenizer import IncrementalDetokenizer
from pagedlm.server import protocol as P
from pagedlm.server.response_models import PromptLogprobs

FLOOR = -9999.0


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def clamp(logprob: float) -> float:
    return max(logprob, FLOOR) if logprob == logprob else FLOOR


def token_str(tok: Decoder, tid: int, entry: PositionLogprobs) -> str:
    """The token's text: as the engine decoded it, else decoded alone."""
    lp = entry.get(tid)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tok.decode([tid], skip_special_tokens=False)


def add_completion(tok: Decoder, lp: P.CompletionLogprobs, token_ids: list[int], entries: list[PositionLogprobs | None],
                   offset: int, as_ids: bool = False) -> int:
    """Append `token_ids` (with their `entries`; None: a position without logprobs) to `lp`, the first at text
    offset `offset`; returns the offset after them. `as_ids` (vLLM's return_tokens_as_token_ids): tokens and the
    top_logprobs' keys as `token_id:<id>`, so that tokens whose texts are equal (or not text: part of a character)
    stay apart."""
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            token = tok.decode([tid], skip_special_tokens=False)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            token = token_str(tok, tid, entry)
            lp.token_logprobs.append(clamp(entry[tid].logprob))
            keys = [f"token_id:{t}" if as_ids else token_str(tok, t, entry) for t in entry]
            lp.top_logprobs.append({k: clamp(e.logprob) for k, e in zip(keys, entry.values())})
        lp.tokens.append(f"token_id:{tid}" if as_ids else token)
        lp.text_offset.append(offset)
        offset += len(token)
    return offset


def chat(tok: Decoder, token_ids: list[int], entries: list[PositionLogprobs] | None, k: int,
         as_ids: bool = False) -> P.ChatLogprobs:
    """A chat answer's logprobs of `token_ids`, each with its top `k` alternatives by rank (`as_ids`: tokens named
    `token_id:<id>`, as add_completion's)."""
    def name(t: int, entry: PositionLogprobs) -> str:
        return f"token_id:{t}" if as_ids else token_str(tok, t, entry)

    content = []
    for tid, entry in zip(token_ids, entries or []):
        top = sorted((e.rank, t, e) for t, e in entry.items() if e.rank is not None and e.rank <= k)[:k]
        content.append(P.ChatLogprob(
            token=name(tid, entry), logprob=clamp(entry[tid].logprob), bytes=list(tok.token_bytes(tid)),
            top_logprobs=[P.TopLogprob(token=name(t, entry), logprob=clamp(e.logprob),
                                       bytes=list(tok.token_bytes(t))) for _, t, e in top]))
    return P.ChatLogprobs(content=content)


class TextTokens:
    """A streamed choice's tokens (with their logprobs), each given to the chunk whose content carries its text.
    The engine sends a token when it is sampled but holds its text back while that ends in an incomplete character
    (or could still become a stop string), and a consumer that falls behind takes several outputs as one: an
    output's text may then end before its last tokens' text, which comes with the next. The engine's incremental
    detokenizer, run again here on the same ids, says where each token's text ends."""

    def __init__(self, hf_tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.detok = IncrementalDetokenizer(hf_tokenizer, prompt_token_ids, skip_special_tokens)
        self.pending: list[tuple[int, PositionLogprobs]] = []  # not given to a chunk yet
        self.ends: list[int] = []  # where the text of pending[i] ends, for those whose text the detokenizer gave
        self.length = 0  # of the text the detokenizer gave
        self.sent = 0  # of the content sent

    def add(self, token_ids: list[int], entries: list[PositionLogprobs], text: str,
            finished: bool) -> tuple[list[int], list[PositionLogprobs]]:
        """The tokens (and entries) of the chunk whose content is `text`: those (pending or new) whose text it
        completes; all of them once the choice `finished`."""
        for tid, entry in zip(token_ids, entries):
            self.pending.append((tid, entry))
            delta = self.detok.append(tid)
            if delta:  # the text of this token and of those held back before it
                self.length += len(delta)
                self.ends += [self.length] * (len(self.pending) - len(self.ends))
        self.sent += len(text)
        n = len(self.pending) if finished else sum(1 for end in self.ends if end <= self.sent)
        ready, self.pending, self.ends = self.pending[:n], self.pending[n:], self.ends[n:]
        return [t for t, _ in ready], [e for _, e in ready]


def prompt(out: RequestOutput) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of a request's output: per prompt position (the first None), token id -> entry."""
    return [None if entry is None else {str(t): P.PromptLogprob(logprob=clamp(lp.logprob), rank=lp.rank,
                                                                decoded_token=lp.decoded_token)
                                        for t, lp in entry.items()}
            for entry in out.prompt_logprobs or []]
