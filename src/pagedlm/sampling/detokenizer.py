"""Incremental detokenization (vLLM / HF TextStreamer style) and stop-string matching."""
from __future__ import annotations

import weakref
from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded as context before the first output token
_SPECIAL_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's special token ids, computed once per tokenizer (transformers rebuilds the list on every
    `convert_ids_to_tokens(..., skip_special_tokens=True)`, a cost per generated token)."""
    ids = _SPECIAL_IDS.get(tokenizer)
    if ids is None:
        ids = _SPECIAL_IDS[tokenizer] = frozenset(tokenizer.all_special_ids)
    return ids


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Only a short window of tokens is re-decoded per step: `prefix_offset:read_offset` is text already
    emitted (context for space/merge rules), `read_offset:` is new. Text ending in U+FFFD (an incomplete
    UTF-8 char) is held back until the next token completes it; `flush()` releases whatever is still held.
    Concatenated deltas (plus `flush()`) equal `tokenizer.decode(output_ids, skip_special_tokens=...)`
    for byte-level BPE tokenizers; `text` joins them (the deltas are kept as pieces: appending one costs its
    length, not the text's).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip = special_ids(tokenizer) if skip_special_tokens else frozenset()
        # Two extra tokens in case some of the context tokens are skipped special tokens.
        self.tokens = self._to_tokens(prompt_token_ids[-_PROMPT_CONTEXT - 2 :])
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT, 0)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _to_tokens(self, ids: list[int]) -> list[str]:
        toks = self.tokenizer.convert_ids_to_tokens([i for i in ids if i not in self._skip])
        return [t or "" for t in toks]  # out-of-vocab ids (padded model vocab) decode to nothing

    def _pending(self) -> tuple[str, str]:
        to_string = self.tokenizer.convert_tokens_to_string
        prefix = to_string(self.tokens[self.prefix_offset : self.read_offset])
        return prefix, to_string(self.tokens[self.prefix_offset :])

    def append(self, token_id: int) -> str:
        """Adds one generated token; returns the new text (may be "" while a char is incomplete)."""
        self.tokens += self._to_tokens([token_id])
        prefix, full = self._pending()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """Releases text held back for an incomplete trailing char (as U+FFFD); call when the sequence ends."""
        prefix, full = self._pending()
        if len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._pieces.append(delta)
        return delta


def find_stop(text: str, delta_len: int, stops: list[str], include_stop: bool) -> tuple[str, str] | None:
    """Finds the earliest stop string that ends inside the last `delta_len` chars of `text`.

    Returns (text cut before the stop, or after it when include_stop, the stop), else None.
    """
    best: tuple[int, str] | None = None
    if delta_len <= 0:
        return None
    for stop in stops:
        i = text.find(stop, max(len(text) - delta_len - len(stop) + 1, 0))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    return text[: i + len(stop)] if include_stop else text[:i], stop


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing chars of `text` a stream must withhold: the longest suffix that is a proper
    prefix of some stop string (it may still grow into a stop and be cut). Looks only at the last
    len(stop) - 1 chars of `text` for each stop."""
    best = 0
    for stop in stops:
        tail = text[max(len(text) - len(stop) + 1, 0):] if len(stop) > 1 else ""
        i = tail.find(stop[0]) if tail else -1
        while i != -1 and len(tail) - i > best:  # candidate starts, longest suffix first
            if stop.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(stop[0], i + 1)
    return best
