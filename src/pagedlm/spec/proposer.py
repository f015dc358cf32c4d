"""The draft interface: a proposer looks at a sequence's tokens and guesses the next ones."""
from __future__ import annotations

from typing import Protocol

import numpy as np


class DraftSeq(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class Proposer(Protocol):
    def propose(self, seq: DraftSeq, max_tokens: int) -> list[int]:
        """At most `max_tokens` (>= 1) tokens that may follow `seq`'s tokens (empty: no guess). Drafts are only a
        guess: the engine verifies each against the model, so a wrong one costs time, never correctness."""
        ...


def match_lengths(haystack: np.ndarray, pattern: np.ndarray, max_n: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Every position i < `end` where `haystack[i]` is `pattern`'s last token, and how many of `pattern`'s last
    tokens (at most `max_n`) end there: haystack[i - n + 1 .. i] == pattern[-n:]."""
    cands = np.flatnonzero(haystack[:max(end, 0)] == pattern[-1]) if len(pattern) else np.zeros(0, dtype=np.int64)
    lengths = np.ones(cands.size, dtype=np.int64)
    alive = np.ones(cands.size, dtype=bool)
    for j in range(1, min(max_n, len(pattern))):
        idx = cands - j
        alive &= idx >= 0
        alive &= haystack[np.maximum(idx, 0)] == pattern[-1 - j]
        if not alive.any():
            break
        lengths += alive
    return cands, lengths


def longest_match(haystack: np.ndarray, pattern: np.ndarray, min_n: int, max_n: int, end: int,
                  prefer_from: int | None = None, follow: int = 1) -> int | None:
    """The position i < `end` in `haystack` where the longest run of `pattern`'s last tokens (at least `min_n`, at
    most `max_n`) ends: haystack[i - n + 1 .. i] == pattern[-n:]. Ties go to runs with `follow` tokens after them
    in `haystack[:end + 1]` if there are such, then to the latest, or with `prefer_from` to the first
    i >= prefer_from. None if no run of `min_n` tokens matches."""
    if len(pattern) < min_n or end <= 0:
        return None
    cands, lengths = match_lengths(haystack, pattern, max_n, end)
    if cands.size == 0:
        return None
    best = int(lengths.max())
    if best < min_n:
        return None
    top = cands[lengths == best]
    long = top[top + follow <= end]
    if long.size:
        top = long
    if prefer_from is not None:
        later = top[top >= prefer_from]
        if later.size:
            return int(later[0])
    return int(top[-1])
