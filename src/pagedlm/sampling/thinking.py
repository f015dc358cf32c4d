"""A thinking-token budget (vLLM's `thinking_token_budget`): once a sample has generated `budget` tokens inside its
reasoning section without closing it, the end-of-thinking tag's tokens are forced next, one per step, and the
answer then goes on freely.

Where the thought starts comes from the reasoning parser's rule (`ReasoningTags.opened`): opened by the prompt
(deepseek_r1: the output starts inside it, after a leading `<think>` if it has one) or by the output (qwen3: only
an output that starts with `<think>`'s tokens thinks). Tags are matched as token ids, encoded as the tokenizer
encodes each tag alone (models whose tags are special tokens, as Qwen3's and DeepSeek-R1's are, always match).

The engine keeps a `ThinkingScan` per sample, advanced over each token the sample keeps, so that a step examines
only the tokens that are new since the previous one (and at most the end tag's length before them), never the
whole output. Tokens not kept yet (speculative drafts) are examined in the step that proposes them, never
recorded; a fork copies its parent's scan; a preempted sample keeps its output, and so its scan."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.sampling.params import SamplingParams

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningTags:
    """The reasoning section's tags, and whether the prompt opened it (else the output must)."""

    opened: bool
    start: str = START
    end: str = END


@dataclass
class ThinkingScan:
    """What a sample's kept output has shown so far: its first `scanned` tokens were searched for the end tag
    (recorded only once the output is at least as long as the start tag, when where the thought begins is
    settled), and whether nothing will ever be forced again (`done`: the thought closed, or the output does not
    think). `examined` counts the tokens searched, in all."""

    scanned: int = 0
    done: bool = False
    examined: int = 0

    def copy(self) -> ThinkingScan:
        return replace(self)

    def advance(self, params: SamplingParams, out: list[int]) -> None:
        """`out`, the sample's kept output, grew by the tokens after `scanned`: search them (and the end tag's
        length before them, for a tag that spans the boundary)."""
        start_ids, end_ids = params._thinking_start_ids, params._thinking_end_ids
        if self.done or len(out) < len(start_ids) or not end_ids or params.reasoning_tags is None:
            return
        begin = thinking_start(params.reasoning_tags, start_ids, out)
        if begin is None:  # the output does not think: nothing to force, ever
            self.done = True
            return
        lo = max(begin, self.scanned - len(end_ids) + 1)
        self.examined += len(out) - lo
        self.done = _find(out, end_ids, lo) != -1
        self.scanned = len(out)


def _find(seq: list[int], sub: list[int], begin: int = 0) -> int:
    """The index of the first occurrence of `sub` in `seq` at or after `begin`, else -1."""
    n = len(sub)
    i = begin
    while True:
        try:
            i = seq.index(sub[0], i)
        except ValueError:
            return -1
        if seq[i:i + n] == sub:
            return i
        i += 1


def thinking_start(tags: ReasoningTags, start_ids: list[int], out: list[int]) -> int | None:
    """Where the reasoning of the output `out` begins (None: the output does not think)."""
    if start_ids and out[:len(start_ids)] == start_ids:
        return len(start_ids)
    return 0 if tags.opened else None


def forced_token(budget: int, tags: ReasoningTags, start_ids: list[int], end_ids: list[int],
                 out: list[int], scan: ThinkingScan | None = None) -> int | None:
    """The token the budget forces after `out` (None: none). With `budget` reasoning tokens generated and the
    thought still open, the next token of the end tag (continuing a part of it the output already ends with), so
    that the reasoning holds at most `budget` tokens. `scan` (the sample's, over a prefix of `out`: the tokens it
    kept) spares searching what it covers; without it the whole reasoning is searched."""
    if (scan is not None and scan.done) or len(out) < budget or not end_ids:
        return None
    begin = thinking_start(tags, start_ids, out)
    if begin is None or len(out) - begin < budget:
        return None
    lo = begin
    if scan is not None:
        lo = max(begin, min(scan.scanned, len(out)) - len(end_ids) + 1)
        scan.examined += len(out) - lo
    if _find(out, end_ids, lo) != -1:
        return None
    for k in range(min(len(end_ids) - 1, len(out) - begin), 0, -1):
        if out[len(out) - k:] == end_ids[:k]:
            return end_ids[k]
    return end_ids[0]


def budget_forced_token(params: SamplingParams, out: list[int], scan: ThinkingScan | None = None) -> int | None:
    """`forced_token` for a request's params (None without a budget)."""
    if params.thinking_token_budget is None or params.reasoning_tags is None:
        return None
    return forced_token(params.thinking_token_budget, params.reasoning_tags, params._thinking_start_ids,
                        params._thinking_end_ids, out, scan)
