"""Logprobs in OpenAI's shapes, from the engine's (`PositionLogprobs`: token id -> logprob, rank, decoded text):
a completion's (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`, built up as deltas arrive), a chat
answer's (`content`, each token with its bytes and its top k by rank) and the prompt's (vLLM's `prompt_logprobs`).
-inf and NaN become -9999.0 (JSON has neither)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedlm.outputs import PositionLogprobs, RequestOutput
from pagedlm.server import protocol as P
from pagedlm.server.response_models import PromptLogprobs

FLOOR = -9999.0


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def clamp(logprob: float) -> float:
    return max(logprob, FLOOR) if logprob == logprob else FLOOR


def token_str(tok: Decoder, tid: int, entry: PositionLogprobs) -> str:
    """The token's text: as the engine decoded it, else decoded alone."""
    lp = entry.get(tid)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tok.decode([tid], skip_special_tokens=False)


def add_completion(tok: Decoder, lp: P.CompletionLogprobs, token_ids: list[int], entries: list[PositionLogprobs | None],
                   offset: int) -> int:
    """Append `token_ids` (with their `entries`; None: a position without logprobs) to `lp`, the first at text
    offset `offset`; returns the offset after them."""
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            token = tok.decode([tid], skip_special_tokens=False)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            token = token_str(tok, tid, entry)
            lp.token_logprobs.append(clamp(entry[tid].logprob))
            lp.top_logprobs.append({token_str(tok, t, entry): clamp(e.logprob) for t, e in entry.items()})
        lp.tokens.append(token)
        lp.text_offset.append(offset)
        offset += len(token)
    return offset


def chat(tok: Decoder, token_ids: list[int], entries: list[PositionLogprobs] | None, k: int) -> P.ChatLogprobs:
    """A chat answer's logprobs of `token_ids`, each with its top `k` alternatives by rank."""
    content = []
    for tid, entry in zip(token_ids, entries or []):
        token = token_str(tok, tid, entry)
        top = sorted((e.rank, t, e) for t, e in entry.items() if e.rank is not None and e.rank <= k)[:k]
        content.append(P.ChatLogprob(
            token=token, logprob=clamp(entry[tid].logprob), bytes=list(token.encode()),
            top_logprobs=[P.TopLogprob(token=(s := token_str(tok, t, entry)), logprob=clamp(e.logprob),
                                       bytes=list(s.encode())) for _, t, e in top]))
    return P.ChatLogprobs(content=content)


def prompt(out: RequestOutput) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` of a request's output: per prompt position (the first None), token id -> entry."""
    return [None if entry is None else {str(t): P.PromptLogprob(logprob=clamp(lp.logprob), rank=lp.rank,
                                                                decoded_token=lp.decoded_token)
                                        for t, lp in entry.items()}
            for entry in out.prompt_logprobs or []]
