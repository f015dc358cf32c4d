"""A thinking-token budget (vLLM's `thinking_token_budget`): once a sample has generated `budget` tokens inside its
reasoning section without closing it, the end-of-thinking tag's tokens are forced next, one per step, and the
answer then goes on freely.

Where the thought starts comes from the reasoning parser's rule (`ReasoningTags.opened`): opened by the prompt
(deepseek_r1: the output starts inside it, after a leading `<think>` if it has one) or by the output (qwen3: only
an output that starts with `<think>`'s tokens thinks). Tags are matched as token ids, encoded as the tokenizer
encodes each tag alone (models whose tags are special tokens, as Qwen3's and DeepSeek-R1's are, always match).
The state is read from the output's tokens at each step, so forks, preemption and drafts need no bookkeeping."""
from __future__ import annotations

from dataclasses import dataclass
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
                 out: list[int]) -> int | None:
    """The token the budget forces after `out` (None: none). With `budget` reasoning tokens generated and the
    thought still open, the next token of the end tag (continuing a part of it the output already ends with), so
    that the reasoning holds at most `budget` tokens."""
    if len(out) < budget or not end_ids:
        return None
    begin = thinking_start(tags, start_ids, out)
    if begin is None or len(out) - begin < budget or _find(out, end_ids, begin) != -1:
        return None
    for k in range(min(len(end_ids) - 1, len(out) - begin), 0, -1):
        if out[len(out) - k:] == end_ids[:k]:
            return end_ids[k]
    return end_ids[0]


def budget_forced_token(params: SamplingParams, out: list[int]) -> int | None:
    """`forced_token` for a request's params (None without a budget)."""
    if params.thinking_token_budget is None or params.reasoning_tags is None:
        return None
    return forced_token(params.thinking_token_budget, params.reasoning_tags, params._thinking_start_ids,
                        params._thinking_end_ids, out)
