"""Suffix drafts (vLLM's `suffix` method, after SuffixDecoding, arXiv 2411.04975, in a simple form): the
sequence's own prompt and output first (prompt lookup), then the outputs of recent requests, so that an agent's
or a code editor's repeated answers draft from each other. Memory is bounded: the outputs of the last
`max_requests` requests that finished, each cut to its last `max_tokens_per_request` tokens."""
from __future__ import annotations

from collections import deque

import numpy as np

from pagedlm.spec.ngram import NgramProposer
from pagedlm.spec.proposer import DraftSeq, longest_match

SEPARATOR = -1  # between two outputs in the searched array: no match crosses it


class SuffixCache:
    """Recent outputs, searched as one array (rebuilt when an output is added)."""

    def __init__(self, max_requests: int, max_tokens_per_request: int = 4096) -> None:
        self.max_tokens_per_request = max_tokens_per_request
        self.outputs: deque[list[int]] = deque(maxlen=max_requests)
        self._array = np.zeros(0, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def add(self, output_token_ids: list[int]) -> None:
        if not output_token_ids or not self.outputs.maxlen:
            return
        self.outputs.append(list(output_token_ids[-self.max_tokens_per_request:]))
        self._array = np.fromiter((t for o in self.outputs for t in (*o, SEPARATOR)), dtype=np.int64)

    def lookup(self, tail: np.ndarray, min_n: int, max_n: int, max_tokens: int) -> list[int]:
        """What followed the longest run of `tail`'s last tokens in a recent output (the latest such run)."""
        a = self._array
        i = longest_match(a, tail, min_n, max_n, len(a) - 1, follow=max_tokens)
        if i is None:
            return []
        draft = a[i + 1:i + 1 + max_tokens]
        stop = np.flatnonzero(draft == SEPARATOR)
        return (draft[:stop[0]] if stop.size else draft).tolist()


class SuffixProposer:
    def __init__(self, cache: SuffixCache, min_n: int, max_n: int) -> None:
        self.cache, self.own = cache, NgramProposer(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: DraftSeq, max_tokens: int) -> list[int]:
        draft = self.own.propose(seq, max_tokens)
        if draft:
            return draft
        tail = np.asarray((seq.prompt_token_ids + seq.output_token_ids)[-self.max_n:], dtype=np.int64)
        return self.cache.lookup(tail, self.min_n, self.max_n, max_tokens)
