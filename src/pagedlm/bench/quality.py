"""Quality of an engine setting against a baseline on the same inputs: perplexity on a fixed text and greedy
token agreement on fixed prompts. Used by `benchmarks/quantization.py` and the quantization tests."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pagedlm.sampling.params import SamplingParams

_SUBJECTS = ["the moon", "photosynthesis", "the French revolution", "prime numbers", "volcanoes", "the printing press",
             "honey bees", "black holes", "the Roman empire", "vaccines", "the water cycle", "electric motors",
             "the Pacific ocean", "chess openings", "glaciers", "the human heart"]
_FORMS = ["Explain {} to a ten-year-old.", "Write three facts about {}.", "What is the history of {}?",
          "Describe {} in one paragraph."]


def quality_prompts(n: int = 64) -> list[str]:
    """`n` fixed English prompts (16 subjects x 4 question forms, cycled)."""
    return [_FORMS[(i // len(_SUBJECTS)) % len(_FORMS)].format(_SUBJECTS[i % len(_SUBJECTS)]) for i in range(n)]


def token_logprobs(llm, token_ids: Sequence[int], window: int = 512) -> list[float]:
    """The log-probability of each token of `token_ids` given the ones before it in its window (consecutive
    non-overlapping windows; each window's first token is not scored), from the engine's prompt logprobs."""
    chunks = [list(token_ids[i:i + window]) for i in range(0, len(token_ids), window)]
    chunks = [c for c in chunks if len(c) > 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(chunks, params, use_tqdm=False)
    return [entry[tok].logprob for chunk, out in zip(chunks, outs)
            for tok, entry in zip(chunk[1:], out.prompt_logprobs[1:])]


def perplexity(llm, token_ids: Sequence[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of `token_ids` (see token_logprobs)."""
    lps = token_logprobs(llm, token_ids, window)
    return math.exp(-sum(lps) / len(lps))


def logprob_drift(logprobs: Sequence[float], reference: Sequence[float]) -> float:
    """Mean |difference| of two runs' token log-probabilities of the same text: how far a setting moves each
    prediction from a reference path (perplexity alone hides that: errors of both signs cancel in its mean)."""
    return sum(abs(a - b) for a, b in zip(logprobs, reference, strict=True)) / len(reference)


@dataclass
class Agreement:
    identical: float  # share of prompts whose outputs are identical
    prefix: float  # mean share of each output generated before the first differing token

    @classmethod
    def of(cls, base: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> "Agreement":
        same, prefix = 0, 0.0
        for a, b in zip(base, other, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            same += list(a) == list(b)
            prefix += n / max(len(a), 1)
        return cls(same / len(base), prefix / len(base))


def greedy_outputs(llm, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Greedy token ids for chat-formatted `prompts` (EOS ignored so every output has `max_tokens` tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
