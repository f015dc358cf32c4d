"""Prompt lookup (vLLM's `ngram` method): the sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) occurred earlier in its prompt or output; the tokens that followed them there are the draft."""
from __future__ import annotations

import numpy as np

from pagedlm.spec.proposer import DraftSeq, longest_match


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: DraftSeq, max_tokens: int) -> list[int]:
        tokens = np.asarray(seq.prompt_token_ids + seq.output_token_ids, dtype=np.int64)
        # the suffix itself ends at len - 1: a match must end before it, with at least one token after
        i = longest_match(tokens, tokens, self.min_n, self.max_n, len(tokens) - 1, follow=max_tokens)
        if i is None:
            return []
        return tokens[i + 1:i + 1 + max_tokens].tolist()
