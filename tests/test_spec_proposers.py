"""Speculative decoding's draft sources and adaptive draft length, without an engine: prompt lookup, predictions,
suffix drafts, the adaptive k and its batch-aware bar."""
from __future__ import annotations

from pagedlm.spec.ngram import NgramProposer
from pagedlm.spec.prediction import PredictionProposer
from pagedlm.spec.state import SpecState


class Seq:
    def __init__(self, prompt, output=()):
        self.prompt_token_ids, self.output_token_ids = list(prompt), list(output)


def test_ngram_finds_the_longest_earlier_match():
    p = NgramProposer(1, 3)
    assert p.propose(Seq([1, 2, 3, 4, 5, 9, 2, 3]), 3) == [4, 5, 9]
    # the longest match wins over a later, shorter one: [7, 2, 3] -> 8
    assert p.propose(Seq([7, 2, 3, 8, 5, 2, 3, 6, 7, 2, 3]), 2) == [8, 5]
    assert p.propose(Seq([1, 2, 3], [4]), 3) == []  # 4 never occurred before
    assert NgramProposer(2, 3).propose(Seq([5, 1, 6, 1]), 2) == []  # only a 1-gram matches


def test_prediction_follows_the_output():
    p = PredictionProposer([10, 11, 12, 13, 14, 15, 16])
    assert p.propose(Seq([1], []), 3) == [10, 11, 12]
    assert p.propose(Seq([1], [10, 11, 12]), 2) == [13, 14]
    # the output inserted tokens, then copies the prediction again: it re-synchronises
    assert p.propose(Seq([1], [10, 11, 12, 13, 99, 98]), 2) == []
    assert p.propose(Seq([1], [10, 11, 12, 13, 99, 98, 14]), 2) == [15, 16]


def test_prediction_jumps_only_on_evidence():
    """After the output departs from the prediction, one common token far from where it departed (a newline, a
    bracket) is no evidence of where it is: no draft. A run of MIN_JUMP tokens is, wherever it is; a single token
    near the departure re-synchronises (a replaced or inserted token)."""
    from pagedlm.spec.prediction import MIN_JUMP, NEAR

    far = list(range(100, 100 + NEAR + 4))
    pred = [10, 11, 12, 13, 7, *far, 7, 20, 21, 22, 23, 24, 25]
    p = PredictionProposer(pred)
    assert p.propose(Seq([1], []), 4) == [10, 11, 12, 13]
    assert p.propose(Seq([1], [10, 11, 50]), 4) == []  # departed at 12: 50 is nowhere
    assert p.propose(Seq([1], [10, 11, 50, 12]), 2) == [13, 7]  # 12 is next to the departure
    out = [10, 11, 12, 13, 60, 61, 7]  # 7 occurs near (position 4) and far (after `far`): the near one
    assert p.propose(Seq([1], out), 2) == [100, 101]
    p = PredictionProposer(pred)
    p.propose(Seq([1], []), 4)
    assert p.propose(Seq([1], [10, 11, 12, 13, 60, 61, 62, 63, 64, 21]), 2) == []  # 21 alone, far away
    assert MIN_JUMP == 3
    assert p.propose(Seq([1], [10, 11, 12, 13, 60, 61, 62, 63, 64, 20, 21, 22]), 2) == [23, 24]


def test_adaptive_k_follows_acceptance():
    state = SpecState(NgramProposer(1, 2), k_max=8)
    for _ in range(10):
        state.record(state.next_k(), state.next_k())  # everything accepted
    assert state.next_k() == 8
    for _ in range(10):
        state.record(4, 0)
    assert state.next_k() == 0  # paused
    assert [state.next_k() for _ in range(8)][-1] == 1  # then probes with one token


def test_the_bar_grows_with_the_batch():
    """A draft row costs about the same time beside more sequences, and each token is worth less of the step: the
    bar for the last draft token scales with the batch, and at five sequences nothing is drafted."""
    state = SpecState(NgramProposer(1, 2), k_max=8)
    state._successes, state._trials = 0.85, 1.0
    alone, two, four = state.next_k(1), state.next_k(2), state.next_k(4)
    assert (alone, two, four) == (8, 5, 1)  # the longest draft whose last token has a 20% / 40% / 80% chance
    assert state.next_k(5) == 0 and state.next_k(1) == alone  # no pause: a smaller batch drafts again
    state.record(4, 0)
    state.record(4, 0)  # alpha below 0.4: pauses beside another sequence, not alone
    assert state.next_k(1) >= 1
    assert state.next_k(2) == 0
    assert SpecState(NgramProposer(1, 2), k_max=8, adaptive=False).next_k(16) == 8  # fixed k: as configured


def test_suffix_drafts_from_recent_outputs():
    from pagedlm.spec.suffix import SuffixCache, SuffixProposer

    cache = SuffixCache(max_requests=2, max_tokens_per_request=6)
    proposer = SuffixProposer(cache, 1, 3)
    seq = Seq([1, 2], [30, 31])
    assert proposer.propose(seq, 4) == []
    cache.add([9, 30, 31, 32, 33])
    assert proposer.propose(seq, 4) == [32, 33]  # never past the end of that output
    cache.add([5, 6])
    cache.add([7, 8])  # the first output leaves the cache (two kept)
    assert proposer.propose(seq, 4) == [] and cache.num_tokens == 4
    cache.add(list(range(100, 120)))  # cut to its last six tokens
    assert cache.num_tokens == 8
    assert proposer.propose(Seq([1], [1, 2, 3, 5, 1, 2]), 2) == [3, 5]  # the sequence's own tokens first
