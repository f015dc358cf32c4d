"""POST /v1/chat/completions for one served model: the messages rendered with the chat template, tool calls (the
answer parsed by the tool parser; a forced tool choice decoded under the calls' grammar), chat logprobs and prompt
logprobs; the answer whole (`Answer`) or as chunks (`Stream`: the role, content deltas, with tools the content up
to the first call and then the calls, the finish)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from pagedlm.engine.client import RequestStream
from pagedlm.engine.protocol import CompletionDelta
from pagedlm.outputs import CompletionOutput
from pagedlm.sampling.detokenizer import held_back
from pagedlm.sampling.params import SamplingParams
from pagedlm.server import protocol as P
from pagedlm.server.endpoints import logprobs as L
from pagedlm.server.endpoints.base import EndpointBase, Prompt
from pagedlm.server.endpoints.results import Answer, Result
from pagedlm.server.limits import check_fan_out
from pagedlm.server.protocol import APIError
from pagedlm.server.streaming import ChoiceState, StreamUsage, collect, final_usage, merge
from pagedlm.server.tools import outside


class ChatEndpoint(EndpointBase):
    async def chat_completions(self, request: Request, req: P.ChatCompletionRequest, arrival: float,
                               routed: bool = False, rid: str | None = None) -> Result:
        check_fan_out(1, req, self.max_prompts_per_request)
        if req.tools_active and self.tool_parser is None:
            raise APIError(400, "This server does not parse tool calls (start it with --tool-call-parser).",
                           param="tools")
        if req.tools_active and req.tool_choice in (None, "auto") and not self.auto_tool_choice:
            raise APIError(400, 'tool_choice "auto" is not served here (the server was started with '
                                '--no-enable-auto-tool-choice): force the calls with "required" or a named function, '
                                'or send "none".', param="tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools_active else None
        ids = await self.stages.run("chat", self.chat_request_prompt, req, tools)
        self.check_prompt(ids)
        params = self._chat_params(req)
        await self.check_and_prepare(request, req, params, [len(ids)], 1)
        rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request, req, rid, [Prompt(ids)], params, arrival)
        if req.stream:
            chunks = self._chat_chunks(req, rid, streams, params, len(ids))
            return await self.stream(request, streams, routed, chunks)
        (out,) = await collect(request, streams)

        def answer() -> P.ChatCompletionResponse:
            return P.ChatCompletionResponse(
                id=rid, model=self.name, choices=[self._chat_choice(req, o) for o in out.outputs],
                usage=final_usage([out], params),
                prompt_logprobs=L.prompt(out) if req.prompt_logprobs is not None else None)

        # with logprobs, the answer is built on the render stage's threads, not on the event loop
        with_logprobs = req.logprobs or req.prompt_logprobs is not None
        return Answer(await self.stages.run("render", answer) if with_logprobs else answer())

    def _chat_params(self, req: P.ChatCompletionRequest) -> SamplingParams:
        """The request's params; a tool choice that forces calls ("required", a named function) adds the calls'
        grammar, which the decoder enforces; a thinking budget comes with the reasoning parser's tags."""
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, logprobs=_top_k(req),
                                     prompt_logprobs=req.prompt_logprobs)
        if req.thinking_token_budget is not None:
            params.thinking_token_budget, params.reasoning_tags = req.thinking_token_budget, req.reasoning_tags
            try:
                params.validate()
            except ValueError as e:
                raise APIError(400, str(e), param="thinking_token_budget") from None
        functions = req.called_functions()
        if functions is not None:
            parallel = req.parallel_tool_calls and not isinstance(req.tool_choice, P.NamedToolChoice)
            try:
                params.structured_outputs = self.tool_parser.call_grammar(functions, parallel)
            except ValueError as e:
                raise APIError(400, f"The tools' call grammar: {e}", param="tools") from None
        return params

    def _chat_choice(self, req: P.ChatCompletionRequest, o: CompletionOutput) -> P.ChatChoice:
        """A whole sample's choice: its message (with tools, the calls parsed out of the text)."""
        message, finish = P.AssistantMessage(content=o.text), o.finish_reason
        if req.tools_active:
            content, calls = self.tool_parser.parse(o.text)
            if calls:
                message = P.AssistantMessage(content=content, tool_calls=[
                    P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments))
                    for c in calls])
                finish = "tool_calls" if finish == "stop" else finish
        k = _top_k(req)
        return P.ChatChoice(index=o.index, message=message, finish_reason=finish, stop_reason=o.stop_reason,
                            logprobs=L.chat(self.tok, o.token_ids, o.logprobs, k, req.return_tokens_as_token_ids)
                            if k is not None else None)

    async def _chat_chunks(self, req: P.ChatCompletionRequest, rid: str, streams: list[RequestStream],
                      params: SamplingParams, prompt_len: int) -> AsyncIterator[P.ChatCompletionChunk]:
        created, n, k = int(time.time()), params.n, _top_k(req)
        states = [ChoiceState() for _ in range(n)]
        usage = StreamUsage([prompt_len], params)

        def chunk(index: int, delta: P.DeltaMessage, **kw: Any) -> P.ChatCompletionChunk:
            return P.ChatCompletionChunk(id=rid, created=created, model=self.name,
                                         usage=usage.info() if req.continuous_usage and req.include_usage else None,
                                         choices=[P.ChatStreamChoice(index=index, delta=delta, **kw)])

        for j in range(n):
            yield chunk(j, P.DeltaMessage(role="assistant", content=""))
        texts: list[L.TextTokens] = []  # with logprobs: each token's goes with the chunk that carries its text
        async for _, out in merge(streams):
            usage.add(0, out)
            if k is not None and not texts:
                texts = [L.TextTokens(self.tok, out.prompt_token_ids or [], params.skip_special_tokens)
                         for _ in range(n)]
            for o in out.outputs:
                st = states[o.index]
                if st.done:
                    continue
                if req.tools_active:
                    for c in self._tool_chunks(st, o, chunk):
                        yield c
                    continue
                st.done = o.finish_reason is not None
                lps = None
                if k is not None:
                    ids, entries = (o.token_ids, None) if o.logprobs is None else \
                        texts[o.index].add(o.token_ids, o.logprobs, o.text, st.done)
                    lps = L.chat(self.tok, ids, entries, k, req.return_tokens_as_token_ids) if ids else None
                if o.text or lps:
                    yield chunk(o.index, P.DeltaMessage(content=o.text), logprobs=lps)
                if st.done:
                    yield chunk(o.index, P.DeltaMessage(), finish_reason=o.finish_reason, stop_reason=o.stop_reason)
        if req.include_usage:
            yield P.ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[], usage=usage.info())

    def _tool_chunks(self, st: ChoiceState, o: CompletionDelta,
                     chunk: Callable[..., P.ChatCompletionChunk]) -> list[P.ChatCompletionChunk]:
        """The chunks of one choice when tools are offered: content up to the first tool call as it comes (a
        possible start of `<tool_call>` held back; stop strings are the engine's), then, once the output is
        complete, the rest of the text outside its calls (as the whole answer's content has it: a block cut short
        is no call) and its calls in one `delta.tool_calls`, finish_reason "tool_calls"."""
        parser = self.tool_parser
        st.text += o.text  # the whole answer: its calls are parsed at the end
        text = st.text
        st.done = o.finish_reason is not None
        cut = text.find(parser.start, max(0, st.sent_chars - len(parser.start) + 1))
        chunks = []
        if not st.done:
            end = cut if cut != -1 else len(text) - held_back(text, [parser.start])
            end = max(end, st.sent_chars)
            if end > st.sent_chars:
                chunks.append(chunk(o.index, P.DeltaMessage(content=text[st.sent_chars:end])))
                st.sent_chars = end
            return chunks
        found = parser.find_calls(text)
        calls = [c for _, _, c in found]
        rest = outside(text, [(a, b) for a, b, _ in found], st.sent_chars)  # as `parse` leaves it in the content
        if rest.strip() or (rest and not calls):
            chunks.append(chunk(o.index, P.DeltaMessage(content=rest)))
        finish = o.finish_reason
        if calls:
            chunks.append(chunk(o.index, P.DeltaMessage(tool_calls=[
                P.DeltaToolCall(index=i, id=c.id, type="function",
                                function=P.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                for i, c in enumerate(calls)])))
            finish = "tool_calls" if finish == "stop" else finish
        chunks.append(chunk(o.index, P.DeltaMessage(), finish_reason=finish, stop_reason=o.stop_reason))
        return chunks


def _top_k(req: P.ChatCompletionRequest) -> int | None:
    """The logprob alternatives a chat request asks for per token (None: no logprobs)."""
    return (req.top_logprobs or 0) if req.logprobs else None
