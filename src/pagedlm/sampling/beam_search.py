"""Beam search bookkeeping for one request, step by step, with HF transformers' scoring rules
(length_penalty, early_stopping True / False / "never"). `BeamSearch.step` chooses the tokens; `plan_beam_step`
says what that means for the beams' sequences: which continue, which fork (chosen twice) and which end. The
engine does it (forking and freeing their KV blocks)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEG = -1.0e9


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # length-normalised
    logprob: float  # raw cumulative log-probability
    eos: bool


@dataclass
class Candidate:
    parent: int  # index of the beam it extends, in the order the beams were given
    token: int
    logprob: float  # cumulative


@dataclass
class BeamSearch:
    width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    eos_token_ids: set[int]
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    def step(self, logprobs: torch.Tensor, beam_scores: list[float], beam_tokens: list[list[int]]) -> list[Candidate]:
        """logprobs: [beams, vocab] log-softmax of each live beam's next-token logits; beam_scores: their
        cumulative log-probabilities; beam_tokens: their generated tokens so far (all the same length).
        Returns the beams to continue with (empty once the search is done)."""
        vocab = logprobs.shape[1]
        gen_len = len(beam_tokens[0]) + 1
        scores = torch.tensor(beam_scores, dtype=torch.float32)
        flat = (logprobs.float() + scores[:, None]).reshape(-1)
        k = min(max(2, 1 + len(self.eos_token_ids)) * self.width, flat.numel())
        top_vals, top_idx = torch.topk(flat, k)
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        vals = top_vals.tolist()
        hits = [t in self.eos_token_ids or gen_len >= self.max_tokens for t in tokens]

        # finished hypotheses: only among the first `width` candidates, as HF does
        full_before = len(self.finished) == self.width
        if self.improvable and not (full_before and self.early_stopping is True):
            new = [Hypothesis(beam_tokens[parents[i]] + [tokens[i]], vals[i] / gen_len ** self.length_penalty,
                              vals[i], tokens[i] in self.eos_token_ids)
                   for i in range(min(self.width, k)) if hits[i]]
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:self.width]

        running = sorted((i for i in range(k) if not hits[i]), key=lambda i: -vals[i])[:self.width]
        if self.improvable and len(self.finished) == self.width and running:
            horizon = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else gen_len
            best = vals[running[0]] / horizon ** self.length_penalty
            self.improvable = best > min(h.score for h in self.finished)
        all_done = len(self.finished) == self.width and self.early_stopping is True
        self.done = not self.improvable or all_done or not running
        if self.done:
            return []
        return [Candidate(parents[i], tokens[i], vals[i]) for i in running]

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]


@dataclass
class BeamStep:
    """One step of a search over its live beams (in the order given): `continued` lists (beam, candidate,
    forked): the candidate continues that beam, in a fork of it when an earlier candidate already continues it;
    `ended` the beams no candidate continues (all of them once the search is done)."""

    continued: list[tuple[int, Candidate, bool]]
    ended: list[int]


def plan_beam_step(beam: BeamSearch, logits: torch.Tensor, scores: list[float],
                   tokens: list[list[int]]) -> BeamStep:
    """Advance `beam` by one token from its live beams' next-token `logits` ([beams, vocab]), their cumulative
    log-probabilities `scores` and generated `tokens`."""
    chosen = beam.step(torch.log_softmax(logits.float(), dim=-1), scores, tokens)
    used: set[int] = set()
    continued = []
    for cand in chosen:
        continued.append((cand.parent, cand, cand.parent in used))
        used.add(cand.parent)
    return BeamStep(continued, [i for i in range(len(scores)) if i not in used])
