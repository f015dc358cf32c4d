"""The draft model (vLLM's `draft_model` method): a smaller model with the target's tokenizer proposes k tokens
greedily, in the engine's process, with a paged KV cache of its own. Batched across sequences: one forward pass
catches every drafting sequence up with its tokens (its whole prompt the first time; after a verification, the
drafts the target accepted and the token it sampled after them), then one pass per further draft position decodes
the next draft token of all of them at once: k forward passes of the draft model per step, whatever the batch.

The draft cache follows each sequence's tokens. Before drafting, the tokens the draft holds K/V for are compared with
the sequence's, and the K/V past the first difference (drafts the target rejected) is rolled back
(`BlockManager.truncate`). A sequence that stops running (finished, preempted, aborted) gives its draft K/V up
(`retain`, called by the engine). The cache is bounded: when it is full, the sequences that drafted longest ago lose
their K/V first (they catch up again when they next draft), and a sequence that still does not fit does not draft
in that step."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.spec.proposer import DraftSeq

DraftChunk = tuple[list[int], int, list[list[int]]]  # token ids, position of the first, block table per KV group


class IdentifiedSeq(DraftSeq, Protocol):
    seq_id: int


class DraftForward(Protocol):
    def __call__(self, chunks: list[DraftChunk], logits_index: list[int]) -> torch.Tensor:
        """One forward pass of the draft model over `chunks`, their K/V written at their block tables' slots; the
        logits (rows x vocabulary) at the flat token positions `logits_index`."""
        ...


@dataclass
class DraftKV:
    """One sequence in the draft cache: the tokens it holds K/V for (the block tables are the block manager's)."""

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    stable: int = 0  # the first `stable` of them are the sequence's own (its length when it last drafted)

    @property
    def num_computed_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Work:
    kv: DraftKV
    tokens: list[int]  # the sequence's
    k: int
    pos: int = 0  # its tokens computed so far in this step's catch-up
    draft: list[int] = field(default_factory=list)


class DraftModel:
    """`forward` runs the draft model over its KV cache, whose blocks `block_manager` keeps. Drafts are the argmax
    over the first `vocab_size` logits (the target's vocabulary); a sequence drafts only up to the draft's
    `max_model_len` tokens; a forward pass takes at most `max_num_batched_tokens` tokens."""

    def __init__(self, forward: DraftForward, block_manager: BlockManager, vocab_size: int, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.forward, self.bm = forward, block_manager
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv: OrderedDict[int, DraftKV] = OrderedDict()  # by seq id, least recently drafted first

    def propose(self, seq: IdentifiedSeq, max_tokens: int) -> list[int]:
        return self.propose_batch([seq], [max_tokens])[0]

    def propose_batch(self, seqs: list[IdentifiedSeq], ks: list[int]) -> list[list[int]]:
        """At most `ks[i]` draft tokens to follow each of `seqs` (empty: no draft), in k forward passes for all."""
        batch = {s.seq_id for s in seqs}
        work: list[_Work | None] = []
        for seq, k in zip(seqs, ks):
            tokens = seq.prompt_token_ids + seq.output_token_ids
            kv = self._sync(seq.seq_id, tokens)
            k = min(k, self.max_model_len - len(tokens) + 1)
            fits = k > 0 and self._reserve(kv, len(tokens) + k - 1, batch)
            work.append(_Work(kv, tokens, k, kv.num_computed_tokens) if fits else None)
        live = [w for w in work if w is not None]
        if live:
            self._catch_up(live)
            for i in range(1, max(w.k for w in live)):
                ahead = [w for w in live if w.k > i]
                chunks = [([w.draft[-1]], len(w.tokens) + i - 1, self.bm.get_block_tables(w.kv)) for w in ahead]
                for w, token in zip(ahead, self._run(chunks, list(range(len(ahead))))):
                    w.draft.append(token)
            for w in live:  # the last draft token was never fed: its K/V is not in the cache
                w.kv.token_ids, w.kv.stable = w.tokens + w.draft[:-1], len(w.tokens)
        return [w.draft if w is not None else [] for w in work]

    def retain(self, seq_ids: Iterable[int]) -> None:
        """Free the draft K/V of every sequence but `seq_ids`."""
        keep = set(seq_ids)
        for seq_id in [s for s in self.kv if s not in keep]:
            self._free(seq_id)

    @property
    def num_seqs(self) -> int:
        return len(self.kv)

    def _free(self, seq_id: int) -> None:
        self.bm.free(self.kv.pop(seq_id))

    def _sync(self, seq_id: int, tokens: list[int]) -> DraftKV:
        """The sequence's draft K/V, rolled back to the longest prefix of `tokens` it holds, short of the last token
        (whose logits are needed). A sequence's tokens only grow, so the comparison starts at `stable`."""
        kv = self.kv.pop(seq_id, None) or DraftKV(seq_id)
        self.kv[seq_id] = kv  # the most recently drafted
        held, end = kv.token_ids, min(len(kv.token_ids), len(tokens) - 1)
        j = kv.stable
        while j < end and held[j] == tokens[j]:
            j += 1
        j = min(j, end)
        if j < len(held):
            self.bm.truncate(kv, j)
            del held[j:]
        kv.stable = min(kv.stable, j)
        return kv

    def _reserve(self, kv: DraftKV, total: int, batch: set[int]) -> bool:
        """Slots for the sequence's first `total` tokens, freeing the K/V of sequences outside `batch`, least
        recently drafted first, if the cache is full; False if they do not fit even so."""
        n = total - kv.num_computed_tokens
        victims = iter([s for s in self.kv if s not in batch])
        while not self.bm.can_append_slots([kv], [n]):
            victim = next(victims, None)
            if victim is None:
                return False
            self._free(victim)
        assert not self.bm.append_slots(kv, n), "a draft cache block is shared"
        return True

    def _catch_up(self, work: list[_Work]) -> None:
        """Each sequence's tokens past those the draft holds, in passes of at most `max_num_batched_tokens` tokens;
        the argmax after its last token is its first draft token."""
        pending = work
        while pending:
            chunks, rows, left = [], [], self.max_num_batched_tokens
            for w in pending:
                take = min(len(w.tokens) - w.pos, left)
                if take <= 0:
                    break
                chunks.append((w.tokens[w.pos:w.pos + take], w.pos, self.bm.get_block_tables(w.kv)))
                w.pos += take
                left -= take
                rows.append(self.max_num_batched_tokens - left - 1)
            for w, token in zip(pending, self._run(chunks, rows)):
                if w.pos == len(w.tokens):
                    w.draft.append(token)
            pending = [w for w in pending if w.pos < len(w.tokens)]

    def _run(self, chunks: list[DraftChunk], rows: list[int]) -> list[int]:
        logits = self.forward(chunks, rows)
        return logits[:, :self.vocab_size].argmax(dim=-1).tolist()
