"""OpenAI's Predicted Outputs: the client sends the text it expects (the file being edited, say); its tokens are
the draft, kept aligned with what was generated so far. Before the first token the prediction's start is the
draft; after, the output's last tokens are found in the prediction (the longest run, the first at or after where the
previous draft was taken) and what follows them there is the draft, so an edit that inserts or drops text
re-synchronises as soon as the output copies the prediction again."""
from __future__ import annotations

import numpy as np

from pagedlm.spec.proposer import DraftSeq, longest_match

MATCH_MAX = 8  # output tokens matched against the prediction


class PredictionProposer:
    def __init__(self, prediction_token_ids: list[int]) -> None:
        self.prediction = np.asarray(prediction_token_ids, dtype=np.int64)
        self.next_pos = 0  # where the previous draft started in the prediction

    def propose(self, seq: DraftSeq, max_tokens: int) -> list[int]:
        out = seq.output_token_ids
        if not out:
            start = 0
        else:
            tail = np.asarray(out[-MATCH_MAX:], dtype=np.int64)
            i = longest_match(self.prediction, tail, 1, MATCH_MAX, len(self.prediction) - 1,
                              prefer_from=max(self.next_pos - 1, 0))
            if i is None:
                return []
            start = i + 1
        self.next_pos = start
        return self.prediction[start:start + max_tokens].tolist()
