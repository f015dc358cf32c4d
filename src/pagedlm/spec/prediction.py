"""OpenAI's Predicted Outputs: the client sends the text it expects (the file being edited, say); its tokens are
the draft, kept aligned with what was generated so far.

The proposer keeps a cursor: where in the prediction the output is expected to go on. While the output copies the
prediction the draft is what follows the cursor. Where the output departs from it (an edit), the cursor stays at
the departure and the output's last tokens are looked for in the prediction: a run of any length near the cursor
(the edit replaced, inserted or dropped a few tokens), a run of `MIN_JUMP` tokens anywhere else (the edit dropped
or rewrote a longer stretch). A single common token far away (a newline, a bracket) is no evidence of where the
output is, and a draft taken from there is nearly always rejected: each rejected draft token is a row of the
verifying step for nothing."""
from __future__ import annotations

import numpy as np

from pagedlm.spec.proposer import DraftSeq, match_lengths

MATCH_MAX = 8  # output tokens matched against the prediction
MIN_JUMP = 3  # matched tokens that move the cursor beyond NEAR
NEAR = 16  # prediction tokens before and after the cursor where any match re-synchronises


class PredictionProposer:
    def __init__(self, prediction_token_ids: list[int]) -> None:
        self.prediction = np.asarray(prediction_token_ids, dtype=np.int64)
        self.cursor = 0  # the prediction's position the output is expected to continue with
        self._drafted_at = -1  # the output's length when the last draft (from the cursor) was taken

    def propose(self, seq: DraftSeq, max_tokens: int) -> list[int]:
        out = seq.output_token_ids
        if out:
            self._advance(out)
            if not self._on_track(out):
                start = self._resync(np.asarray(out[-MATCH_MAX:], dtype=np.int64))
                if start is None:
                    return []
                self.cursor = start
        self._drafted_at = len(out)
        return self.prediction[self.cursor:self.cursor + max_tokens].tolist()

    def _advance(self, out: list[int]) -> None:
        """Move the cursor over the output's new tokens as far as they copied the prediction from it (where the last
        draft started)."""
        if self._drafted_at < 0 or self._drafted_at > len(out):
            return
        new = np.asarray(out[self._drafted_at:], dtype=np.int64)
        ahead = self.prediction[self.cursor:self.cursor + len(new)]
        same = new[:len(ahead)] == ahead
        copied = len(ahead) if same.all() else int(np.argmin(same))
        self.cursor += copied
        self._drafted_at = -1

    def _on_track(self, out: list[int]) -> bool:
        """The output's last token is the prediction's token just before the cursor."""
        return 0 < self.cursor <= len(self.prediction) and self.prediction[self.cursor - 1] == out[-1]

    def _resync(self, tail: np.ndarray) -> int | None:
        """The prediction's position after the best match of the output's last tokens: a match within NEAR of the
        cursor (the longest, then the nearest), else one of MIN_JUMP tokens or more (the longest, then the first
        after the cursor)."""
        cands, lengths = match_lengths(self.prediction, tail, MATCH_MAX, len(self.prediction) - 1)
        if cands.size == 0:
            return None
        near = np.abs(cands + 1 - self.cursor) <= NEAR
        if near.any():
            c, n = cands[near], lengths[near]
            c = c[n == n.max()]
            return int(c[np.argmin(np.abs(c + 1 - self.cursor))]) + 1
        far = lengths >= MIN_JUMP
        if not far.any():
            return None
        c, n = cands[far], lengths[far]
        c = c[n == n.max()]
        later = c[c + 1 >= self.cursor]
        return int(later[0] if later.size else c[-1]) + 1
