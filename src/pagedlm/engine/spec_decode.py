"""Speculative decoding's engine side. Before a step, each running sequence that speculates proposes its draft
(spec/); the scheduler gives a decoding sequence's draft tokens slots and schedules them with its next token, so
they go through the step's one forward pass with every other sequence's decode and prefill chunks; the step reads
back a logits row per draft position (step.py), verifies the drafts (sample.py: `StepSampler._append_verified`),
and the scheduler keeps the accepted drafts' K/V and returns the rejected tail's slots (`BlockManager.truncate`).

Which sequences speculate: a request with a `prediction` (its tokens are the draft), else, with a
`SpeculativeConfig`, every request by prompt lookup, suffix drafts or the draft model; never beam searches. A
constrained request's draft ends before the first token its grammar rejects (`constrain`), and the step verifies each
draft position under the grammar's mask at that position (sample.py), so its output is the same as without drafts.
No sequence speculates in a step that runs more than `disable_by_batch_size` sequences (a prediction: more than
PREDICTION_BATCH_SIZE, if that is larger). The draft model
(engine/draft_loader.py) drafts for all its sequences at once and keeps K/V only for running sequences
(`SpecDecoder.retain`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedlm.config import SpeculativeConfig
from pagedlm.engine.scheduler import FinishedSeq, SchedulerOutput
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.spec.draft_model import DraftModel
from pagedlm.spec.ngram import NgramProposer
from pagedlm.spec.prediction import PredictionProposer
from pagedlm.spec.state import SpecState
from pagedlm.spec.suffix import SuffixCache, SuffixProposer

# The most draft tokens of a prediction per step: a client's prediction is nearly all right or clearly wrong (the
# proposer drafts only where the output is copying it), 16 against 8 gave 4.3x against 3.8x on a one-line code edit.
PREDICTION_TOKENS = 16
PREDICTION_BATCH_SIZE = 4  # a prediction speculates while at most this many sequences run (or the config's number)

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: steps that verified a draft, draft tokens, accepted tokens (and by position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def total(cls, parts: list[SpecStats]) -> SpecStats:
        """Several engines' counters summed (replicas)."""
        out = cls(sum(p.num_drafts for p in parts), sum(p.num_draft_tokens for p in parts),
                  sum(p.num_accepted_tokens for p in parts))
        for p in parts:
            out.accepted_per_pos += [0] * (len(p.accepted_per_pos) - len(out.accepted_per_pos))
            for j, n in enumerate(p.accepted_per_pos):
                out.accepted_per_pos[j] += n
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculating step: the accepted drafts plus the token sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    """`drafter`: the draft model, for `config.method` draft_model (engine/draft_loader.py)."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int, drafter: DraftModel | None = None) -> None:
        self.config, self.max_model_len, self.drafter = config, max_model_len, drafter
        self.stats = SpecStats()
        self._seen = config is not None  # a sequence may speculate (sticky: a prediction was seen)
        self.suffix_cache = (SuffixCache(config.suffix_decoding_max_cached_requests)
                             if config is not None and config.method == "suffix" else None)

    def state_for(self, req: Request) -> SpecState | None:
        """The speculation of a new sequence of `req` (None: it does not speculate)."""
        p, cfg = req.params, self.config
        if p.use_beam_search or req.pooler is not None:
            return None
        if p._prediction_token_ids:
            self._seen = True
            return SpecState(PredictionProposer(p._prediction_token_ids), PREDICTION_TOKENS,
                             cfg.adaptive if cfg else True, len(p._prediction_token_ids))
        if cfg is None or not (cfg.sampled or p.greedy):
            return None
        if cfg.method == "draft_model":
            return SpecState(self.drafter, cfg.num_speculative_tokens, cfg.adaptive) if self.drafter else None
        lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        proposer = SuffixProposer(self.suffix_cache, lo, hi) if self.suffix_cache is not None else \
            NgramProposer(lo, hi)
        return SpecState(proposer, cfg.num_speculative_tokens, cfg.adaptive)

    def propose(self, running: list[Request]) -> None:
        """Each running sequence's draft for the next step (none while the batch is too large)."""
        if not self._seen:
            return
        live = [(r, s) for r in running for s in r.live_seqs]
        limit = self.config.disable_by_batch_size if self.config else PREDICTION_BATCH_SIZE
        predicted = max(limit, PREDICTION_BATCH_SIZE)
        batch, ks = [], []  # the draft model's, drafted together
        for req, seq in live:
            if seq.spec is None:
                continue
            seq.spec.draft_token_ids = []
            most = predicted if seq.spec.prediction_len else limit
            if len(live) > most or seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1 \
                    or req.params.structured_outputs is not None and seq.matcher is None:
                continue
            if self.drafter is not None and seq.spec.proposer is self.drafter:
                k = seq.spec.draft_length(self._room(req, seq), len(live))
                if k > 0:
                    batch.append(seq)
                    ks.append(k)
            else:
                seq.spec.propose(seq, self._room(req, seq), len(live))
                constrain(seq)
        if batch:
            try:
                drafts = self.drafter.propose_batch(batch, ks)
            except Exception:  # noqa: BLE001 - a draft is only a guess: the step goes on without
                logger.exception("The draft model failed; this step runs without its drafts")
                self.drafter.retain(())
                return
            for seq, draft in zip(batch, drafts):
                seq.spec.draft_token_ids = draft
                constrain(seq)

    def retain(self, running: list[Request]) -> None:
        """The draft model keeps K/V for the running sequences only (the others finished, were preempted or were
        aborted)."""
        if self.drafter is not None:
            self.drafter.retain(s.seq_id for r in running for s in r.live_seqs)

    def _room(self, req: Request, seq: Sequence) -> int:
        """Draft tokens that could still be kept: all accepted plus the token after them fit max_tokens and the
        context."""
        room = self.max_model_len - seq.num_tokens - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - len(seq.output_token_ids) - 1)
        return room

    def count(self, sched: SchedulerOutput, finished: list[FinishedSeq]) -> None:
        """The step `sched` ran: its verified drafts into the counters, the outputs that ended into the suffix
        cache."""
        if self.suffix_cache is not None:
            for f in finished:
                if f.status is not SequenceStatus.FINISHED_ABORTED:
                    self.suffix_cache.add(f.seq.output_token_ids)
        st = self.stats
        for s in sched.scheduled:
            if not s.num_draft_tokens:
                continue
            st.num_drafts += 1
            st.num_draft_tokens += s.num_draft_tokens
            st.num_accepted_tokens += s.num_accepted_tokens
            if len(st.accepted_per_pos) < s.num_draft_tokens:
                st.accepted_per_pos += [0] * (s.num_draft_tokens - len(st.accepted_per_pos))
            for j in range(s.num_accepted_tokens):
                st.accepted_per_pos[j] += 1


def constrain(seq: Sequence) -> None:
    """A constrained sequence's draft cut before the first token its grammar (`seq.matcher`, in the state of the
    sequence's output) rejects; the matcher only checks the tokens, its state does not change."""
    draft = seq.spec.draft_token_ids
    if draft and seq.matcher is not None:
        seq.spec.draft_token_ids = draft[:seq.matcher.validate_tokens(draft)]
