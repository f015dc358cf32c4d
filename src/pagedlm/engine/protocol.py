"""The engine's one contract with its callers, the same in process (AsyncLLMEngine's queue) and over Ray (a
replica's poll): a typed `EngineRequest` goes in, `EngineOutput` deltas come out (vLLM's EngineCoreRequest /
EngineCoreOutput).

An EngineRequest is what the InputProcessor (input_processor.py) built and checked: the engine trusts it. One
with `pooling` set (`PoolingParams`) generates nothing: its prompt's final hidden states are pooled into one
vector, which its only (finished) output carries as `embedding`.

An EngineOutput carries only what is new since the request's previous output: per sample (`CompletionDelta`) the
new token ids, their text, their logprobs, and the finish and stop reason once it ended. Text that could still
become a stop string is held back until it cannot (the output processor cuts stop strings), so a consumer only
appends. The first output of a request also carries its prompt (token ids, logprobs, cached tokens); a request the
engine failed ends with an output whose `error` is set. Outputs nobody has taken yet merge (`merge_outputs`).
`OutputAccumulator` folds a request's outputs into the cumulative `RequestOutput` (offline `LLM`, non-streaming
responses).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedlm.engine.errors import EngineError
from pagedlm.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagedlm.sampling.params import SamplingParams

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the prompt's final hidden states (after the model's final norm) pooled into one
    vector, the last token's (`last`: under causal attention it has seen every other) or the mean over every
    token (`mean`), L2-normalized unless `normalize` is off."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"Unknown pooling {self.pooling!r}; known: {', '.join(POOLING_TYPES)}.")


@dataclass
class EngineRequest:
    """A checked request: its prompt as token ids (and the text, if it came as text) and prepared params;
    `pooling`: an embedding request (its params are not sampled from)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    pooling: PoolingParams | None = None


@dataclass
class CompletionDelta:
    """What is new of one sample (index `index` of its request); field names as `CompletionOutput`'s."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort", once the sample ended
    stop_reason: int | str | None = None


@dataclass
class FinishedRequestStats:
    """A request that ended (finished, aborted or failed), as metrics and routing budgets count it."""

    request_id: str
    num_prompt_tokens: int
    num_generation_tokens: int  # over all its samples
    finish_reasons: list[str]  # one per sample: "stop" | "length" | "abort"
    metrics: RequestMetrics | None

    @property
    def aborted(self) -> bool:
        """Aborted or failed (its latencies are not those of a finished request)."""
        return "abort" in self.finish_reasons


@dataclass
class EngineOutput:
    """What is new of one request since its previous output; `outputs` holds the samples with news."""

    request_id: str
    outputs: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False
    prompt_token_ids: list[int] | None = None  # first output only (as the prompt fields below)
    prompt: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: EngineError | None = None  # the engine failed the request (it finished)
    stats: FinishedRequestStats | None = None  # with the last output
    embedding: list[float] | None = None  # a pooling request's vector, with its last output

    @property
    def num_new_tokens(self) -> int:
        return sum(len(d.token_ids) for d in self.outputs)


def merge_outputs(items: list[EngineOutput]) -> EngineOutput:
    """Consecutive outputs of one request as one (what a consumer that fell behind takes), in O(their size)."""
    if len(items) == 1:
        return items[0]
    first, last = items[0], items[-1]
    merged = EngineOutput(first.request_id, [], last.finished, first.prompt_token_ids, first.prompt,
                          first.prompt_logprobs, first.num_cached_tokens, last.metrics, last.error, last.stats,
                          last.embedding)
    by_index: dict[int, CompletionDelta] = {}
    texts: dict[int, list[str]] = {}
    for out in items:
        for d in out.outputs:
            m = by_index.get(d.index)
            if m is None:
                m = by_index[d.index] = CompletionDelta(d.index, [], "", None)
                merged.outputs.append(m)
                texts[d.index] = []
            m.token_ids.extend(d.token_ids)
            texts[d.index].append(d.text)
            if d.logprobs is not None:
                m.logprobs = m.logprobs if m.logprobs is not None else []
                m.logprobs.extend(d.logprobs)
            m.cumulative_logprob, m.finish_reason, m.stop_reason = d.cumulative_logprob, d.finish_reason, d.stop_reason
    for m in merged.outputs:
        m.text = "".join(texts[m.index])
    return merged


class OutputAccumulator:
    """One request's outputs folded into its cumulative `RequestOutput`: each `add` costs what the output holds."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.finished = False
        self.error: EngineError | None = None
        self.embedding: list[float] | None = None
        self._samples: dict[int, CompletionOutput] = {}
        self._texts: dict[int, list[str]] = {}

    def add(self, out: EngineOutput) -> None:
        if out.prompt_token_ids is not None:
            self.prompt, self.prompt_token_ids = out.prompt, out.prompt_token_ids
            self.prompt_logprobs, self.num_cached_tokens = out.prompt_logprobs, out.num_cached_tokens
        self.metrics = out.metrics or self.metrics
        self.finished, self.error = out.finished, out.error or self.error
        self.embedding = out.embedding or self.embedding
        for d in out.outputs:
            s = self._samples.get(d.index)
            if s is None:
                s = self._samples[d.index] = CompletionOutput(d.index, "", [])
                self._texts[d.index] = []
            s.token_ids.extend(d.token_ids)
            self._texts[d.index].append(d.text)
            if d.logprobs is not None:
                s.logprobs = s.logprobs if s.logprobs is not None else []
                s.logprobs.extend(d.logprobs)
            s.cumulative_logprob, s.finish_reason, s.stop_reason = d.cumulative_logprob, d.finish_reason, d.stop_reason

    def output(self) -> RequestOutput:
        """The request so far (its lists are the accumulator's own: take it once the request finished, or use
        `snapshot`)."""
        outputs = [self._samples[i] for i in sorted(self._samples)]
        for o in outputs:
            pieces = self._texts[o.index]
            if len(pieces) > 1:
                pieces[:] = ["".join(pieces)]
            o.text = pieces[0] if pieces else ""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.prompt_logprobs, self.metrics, self.num_cached_tokens, self.error, self.embedding)

    def snapshot(self) -> RequestOutput:
        """The request so far as a copy (costs its size)."""
        out = self.output()
        out.outputs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                                        list(o.logprobs) if o.logprobs is not None else None, o.finish_reason,
                                        o.stop_reason) for o in out.outputs]
        return out
