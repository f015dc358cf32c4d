"""Batched next-token sampling: penalties, logit_bias, allowed_token_ids, bad_words, min_tokens, grammar masks,
temperature, top-k/top-p/min-p, seeded draws, logprobs; last, a thinking budget's forced tag (sampling/thinking.py),
which overrides every control but a grammar (a tag the grammar forbids is not forced).

Every step is a tensor op over the whole batch (or the subset of rows that need it); rows whose
parameters disable a step are left unchanged by it. Logprobs always describe the raw model
distribution (log_softmax of the unprocessed logits), as in vLLM.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedlm.outputs import Logprob, PositionLogprobs
from pagedlm.sampling.logits_kernel import argmax_logsumexp
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.thinking import ThinkingScan, budget_forced_token

_PROMPT_LOGPROBS_CHUNK = 512  # positions per log_softmax in prompt_logprobs, bounds peak memory


@dataclass
class SamplingRow:
    """One sequence to sample a token for in this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far
    generator: torch.Generator | None = None  # seeded requests (on the logits' device); None -> global RNG
    bitmask: torch.Tensor | None = None  # constrained rows: int32 [words], bit t set = token t allowed
    thinking: ThinkingScan | None = None  # a thinking budget's scan of the sequence's kept output (thinking.py)


def build_allowed_mask(token_ids: list[int], vocab: int) -> torch.Tensor:
    """[vocab] bool: True at the given ids (ids >= vocab ignored)."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids[ids < vocab]] = True
    return mask


def allowed_mask(params: SamplingParams, vocab: int) -> torch.Tensor:
    """The request's allowed_token_ids as a [vocab] bool mask, built on first use and kept on `params` (so once
    per request, whatever its rows and steps)."""
    mask = params._allowed_mask
    if mask is None or mask.shape[0] != vocab:
        mask = params._allowed_mask = build_allowed_mask(params.allowed_token_ids, vocab)
    return mask


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float]  # raw logprob of the chosen token
    top_logprobs: list[PositionLogprobs | None]  # rows with params.logprobs set: chosen + top-k, else None


_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1  # [256, 8]: the bits of each byte


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, allowed: bool = True) -> torch.Tensor:
    """int32 [N, words] -> bool [N, vocab]: True where the token is allowed (with allowed=False: where it is not);
    ids past 32 * words are not allowed."""
    n = bitmask.shape[0]
    table = _BYTE_BITS.to(bitmask.device).bool()
    if not allowed:
        table = ~table
    bits = table[bitmask.contiguous().view(torch.uint8).long()].view(n, -1)  # little-endian: bit t of word t // 32
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.full((n, vocab - bits.shape[1]), not allowed, dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, pad], 1)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32 occurrence counts (ids >= vocab are dropped)."""
    lens = torch.tensor([len(t) for t in token_lists])
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lens.sum()))
    row = torch.repeat_interleave(torch.arange(len(token_lists)), lens)
    index = (row * (vocab + 1) + torch.from_numpy(flat).clamp_(max=vocab)).to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.view(-1).scatter_add_(0, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab]


def _position_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[PositionLogprobs]:
    """For each row of `logprobs` [N, V]: {chosen token, then the top-ks[i] tokens}. A rank is 1 + the number of
    tokens with a strictly higher logprob, so tied tokens share a rank (a greedy choice among ties is rank 1)."""
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_lp).sum(-1).add_(1).tolist()
    kmax = min(max(ks, default=0), logprobs.shape[1])
    if kmax:
        top_lp, top_ids = (t.tolist() for t in logprobs.topk(kmax, dim=-1))
    else:
        top_lp = top_ids = [[] for _ in ks]
    out = []
    for i, (tok, lp, rank, k) in enumerate(zip(chosen.tolist(), chosen_lp[:, 0].tolist(), ranks, ks)):
        entry = {tok: Logprob(lp, rank)}
        values = top_lp[i][:k]
        for r, (t, v) in enumerate(zip(top_ids[i][:k], values)):
            if t != tok:
                entry[t] = Logprob(v, values.index(v) + 1)  # topk is sorted: the first equal value gives the rank
        out.append(entry)
    return out


class Sampler:
    """Picks one token per row. `eos_token_ids` are masked (with stop_token_ids) while min_tokens is unmet.
    `seed` (the engine's): rows without a generator of their own draw from one seeded with it (None: torch's
    global RNG), so the same requests in the same order sample the same tokens."""

    def __init__(self, eos_token_ids: set[int] | frozenset[int] = frozenset(), seed: int | None = None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The engine-seeded generator on `device` (None without a seed)."""
        if self.seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [len(rows), vocab], any float dtype (computed in float32, never modified)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        if not rows:
            return SamplerOutput([], [], [])
        raw = logits.float()
        banned = [self._banned_ids(r, raw.shape[1]) for r in rows]
        if all(r.params.greedy and not _has_penalty(r.params) and (r.bitmask is not None or not
               r.params.needs_logits_processing) and not r.params._bad_words_token_ids and not r.params.logit_bias
               and r.params.allowed_token_ids is None for r in rows) and not any(banned):
            tokens, lse = argmax_logsumexp(raw)
            # a grammar only matters where the model's own choice breaks it
            bad = [i for i, (r, t) in enumerate(zip(rows, tokens.tolist())) if r.bitmask is not None
                   and not (int(r.bitmask[t // 32]) >> (t % 32)) & 1]
            if bad:
                idx = torch.tensor(bad, device=raw.device)
                tokens[idx] = self._sample(raw[idx], [rows[i] for i in bad], [banned[i] for i in bad])
        else:
            tokens, lse = self._sample(raw, rows, banned), None
        self._force_thinking_end(tokens, rows, raw.shape[1])
        return self._output(raw, tokens, rows, lse)

    @staticmethod
    def _force_thinking_end(tokens: torch.Tensor, rows: list[SamplingRow], vocab: int) -> None:
        """Rows whose thinking budget is spent take the end tag's next token (where their grammar allows it)."""
        forced = []
        for i, r in enumerate(rows):
            t = budget_forced_token(r.params, r.output_token_ids, r.thinking)
            if t is not None and t < vocab and (r.bitmask is None or (int(r.bitmask[t // 32]) >> (t % 32)) & 1):
                forced.append((i, t))
        if forced:
            idx, ids = zip(*forced)
            tokens[torch.tensor(idx, device=tokens.device)] = torch.tensor(ids, dtype=tokens.dtype,
                                                                          device=tokens.device)

    def _banned_ids(self, row: SamplingRow, vocab: int) -> list[int]:
        """min_tokens (eos and stop_token_ids while unmet), and the last token of each bad word whose other
        tokens end the output."""
        p, out = row.params, row.output_token_ids
        ids = set()
        if len(out) < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        for word in p._bad_words_token_ids:
            k = len(word) - 1
            if k == 0 or (len(out) >= k and out[len(out) - k:] == word[:-1]):
                ids.add(word[-1])
        return sorted(i for i in ids if i < vocab)

    def _sample(self, raw: torch.Tensor, rows: list[SamplingRow], banned: list[list[int]]) -> torch.Tensor:
        x = raw.clone()
        dev, vocab = x.device, x.shape[1]
        params = [r.params for r in rows]

        pen = [i for i, p in enumerate(params) if _has_penalty(p)]
        if pen:
            idx = torch.tensor(pen, device=dev)
            x[idx] = self._apply_penalties(x[idx], [rows[i] for i in pen])

        bias = [(i, t, v) for i, p in enumerate(params) for t, v in (p.logit_bias or {}).items() if t < vocab]
        if bias:
            r, t, v = zip(*bias)
            x.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                         torch.tensor(v, dtype=x.dtype, device=dev), accumulate=True)

        only = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        if only:
            keep = torch.stack([allowed_mask(params[i], vocab) for i in only]).to(dev)
            idx = torch.tensor(only, device=dev)
            x[idx] = x[idx].masked_fill(~keep, float("-inf"))

        ban_rows = [i for i, ids in enumerate(banned) for _ in ids]
        if ban_rows:
            ban_cols = [t for ids in banned for t in ids]
            x[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = float("-inf")

        grammar = [i for i, r in enumerate(rows) if r.bitmask is not None]
        if grammar:
            disallowed = unpack_bitmask(torch.stack([rows[i].bitmask for i in grammar]).to(dev), vocab, False)
            if len(grammar) == len(rows):
                x.masked_fill_(disallowed, float("-inf"))
            else:
                idx = torch.tensor(grammar, device=dev)
                x[idx] = x[idx].masked_fill(disallowed, float("-inf"))
        # rows where several controls restrict the choice may be left with nothing: then the grammar alone decides
        # (else the model); one control alone never empties a row (a grammar always allows something)
        risky = [i for i, p in enumerate(params)
                 if (rows[i].bitmask is not None) + (p.allowed_token_ids is not None) + bool(banned[i])
                 + bool(p.logit_bias) > 1]
        for i in risky:
            if bool((x[i] == float("-inf")).all()):
                x[i] = raw[i]
                if rows[i].bitmask is not None:
                    x[i] = x[i].masked_fill(disallowed[grammar.index(i)], float("-inf"))

        samp = [i for i, p in enumerate(params) if not p.greedy]
        all_rows = len(samp) == len(rows)
        tokens = None if all_rows else x.argmax(-1)  # greedy rows keep this
        if not samp:
            return tokens
        idx = torch.tensor(samp, device=dev)
        sub = x if all_rows else x[idx]
        sp = [params[i] for i in samp]
        temps = torch.tensor([p.temperature for p in sp], device=dev)
        if (temps != 1.0).any():
            sub.div_(temps[:, None])
        probs = self._filter(sub, sp, vocab).softmax(-1)
        q = self._exponentials(probs, [rows[i].generator for i in samp])
        chosen = probs.div_(q).argmax(-1)  # exponential race: a sample from `probs`
        if all_rows:
            return chosen
        tokens[idx] = chosen
        return tokens

    @staticmethod
    def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition (over prompt+output, CTRL style), then presence/frequency (over output, OpenAI style)."""
        dev, vocab = x.device, x.shape[1]
        out_counts = _counts([r.output_token_ids for r in rows], vocab, dev)
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]
        if (rep != 1.0).any():
            seen = (out_counts > 0) | (_counts([r.prompt_token_ids for r in rows], vocab, dev) > 0)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
        return x - freq * out_counts - pres * (out_counts > 0)

    @staticmethod
    def _filter(x: torch.Tensor, params: list[SamplingParams], vocab: int) -> torch.Tensor:
        """top_k, then top_p (on the top-k-renormalised distribution), then min_p; removed logits -> -inf."""
        dev, ninf = x.device, float("-inf")
        ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)[:, None]
        use_k = bool((ks < vocab).any())
        if any(p.top_p < 1.0 for p in params):  # one sort over the batch
            srt, order = x.sort(-1, descending=True)
            remove = torch.arange(vocab, device=dev)[None, :] >= ks
            if use_k:
                srt = srt.masked_fill(remove, ninf)
            tp = torch.tensor([p.top_p for p in params], device=dev)[:, None]
            sp = srt.softmax(-1)
            ahead = sp.cumsum(-1).sub_(sp)  # mass strictly ahead of each token: the top token always stays
            remove |= (ahead >= tp) & (tp < 1.0)
            remove[:, 0] = False  # the top token stays, however small top_p is in float32
            x = x.masked_fill(torch.empty_like(remove).scatter_(1, order, remove), ninf)
        elif use_k:  # no sort: threshold at each row's k-th largest logit (ties at the k-th all stay)
            kmax = int(ks[ks < vocab].max())
            kth = x.topk(kmax, dim=-1).values.gather(1, ks.clamp(max=kmax) - 1).masked_fill_(ks == vocab, ninf)
            x = x.masked_fill(x < kth, ninf)
        if any(p.min_p > 0.0 for p in params):
            mp = torch.tensor([p.min_p for p in params], device=dev)[:, None]
            probs = x.softmax(-1)
            x = x.masked_fill(probs < mp * probs.amax(-1, keepdim=True), ninf)
        return x

    def _exponentials(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exponential(1) noise shaped like probs; seeded rows draw their own row from their generator, the others
        from the engine's."""
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        engine = self.generator(probs.device)
        if len(unseeded) == len(generators):
            q.exponential_(generator=engine)
        else:
            for i, g in enumerate(generators):
                if g is not None:
                    q[i].exponential_(generator=g)
            if unseeded:
                idx = torch.tensor(unseeded, device=probs.device)
                q[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=engine)
        return q.clamp_min_(1e-20)  # a zero would turn 0/0 into NaN, which argmax would pick

    @staticmethod
    def _output(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                lse: torch.Tensor | None = None) -> SamplerOutput:
        """Tokens, their logprobs and the requested top logprobs; `lse`: raw's row log-sum-exp, if computed."""
        lse = (argmax_logsumexp(raw)[1] if lse is None else lse)[:, None]
        chosen_lp = (raw.gather(1, tokens[:, None]) - lse)[:, 0].tolist()
        top: list[PositionLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            if len(want) == len(rows):
                lps, toks = raw - lse, tokens
            else:
                idx = torch.tensor(want, device=raw.device)
                lps, toks = raw[idx] - lse[idx], tokens[idx]
            entries = _position_logprobs(lps, toks, [rows[i].params.logprobs for i in want])
            for i, e in zip(want, entries):
                top[i] = e
        return SamplerOutput(tokens.tolist(), chosen_lp, top)


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], k: int) -> list[PositionLogprobs]:
    """logits[t] predicts target_ids[t]; each entry holds the target token (with its rank) plus the top-k."""
    assert logits.shape[0] == len(target_ids), (tuple(logits.shape), len(target_ids))
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    out: list[PositionLogprobs] = []
    for s in range(0, len(target_ids), _PROMPT_LOGPROBS_CHUNK):
        e = s + _PROMPT_LOGPROBS_CHUNK
        lps = torch.log_softmax(logits[s:e].float(), -1)
        out += _position_logprobs(lps, targets[s:e], [k] * lps.shape[0])
    return out
