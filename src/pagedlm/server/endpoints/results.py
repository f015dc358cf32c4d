"""What an OpenAI endpoint answers before it is rendered (render.py): a whole answer (`Answer`: its typed body) or
a streamed one (`Stream`: its typed chunks as the engine's deltas arrive). Whoever runs an endpoint reads the
result itself (the auto model's cascade judges an `Answer`'s logprobs) and renders it last."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedlm.engine.client import RequestStream
from pagedlm.server import protocol as P

Body = P.CompletionResponse | P.ChatCompletionResponse
Chunk = P.CompletionResponse | P.ChatCompletionChunk


@dataclass
class Answer:
    """A complete answer (the request did not ask for a stream, or the cascade asked for all of it)."""

    body: Body

    @property
    def chat(self) -> bool:
        return isinstance(self.body, P.ChatCompletionResponse)

    def choices(self) -> list[P.CompletionChoice] | list[P.ChatChoice]:
        return sorted(self.body.choices, key=lambda c: c.index)

    def text(self, choice: P.CompletionChoice | P.ChatChoice) -> str:
        return (choice.message.content or "") if self.chat else choice.text

    def token_logprobs(self, choice: P.CompletionChoice | P.ChatChoice) -> list[float]:
        """The logprob of each token `choice` generated (none when the request asked for no logprobs)."""
        if choice.logprobs is None:
            return []
        if self.chat:
            return [c.logprob for c in choice.logprobs.content or []]
        return [v for v in choice.logprobs.token_logprobs if v is not None]


@dataclass
class Stream:
    """A streamed answer: its `chunks`, which end when its engine `streams` end (an engine failure raises its
    EngineError from them), and the engine's `stall_timeout` (render.EventStream). No engine streams: a replay."""

    chunks: AsyncIterator[Chunk]
    streams: list[RequestStream] = field(default_factory=list)
    stall_timeout: float = 0.0


Result = Answer | Stream
