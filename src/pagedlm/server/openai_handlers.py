"""The OpenAI endpoints of one served model (`ModelServer`), once its model is resolved: prompts tokenized and
checked, the request submitted to its engine, and the outputs answered as a response or an SSE stream
(completions, chat with tool calls, logprobs), plus its tokenizer endpoints. The engine is seen only through
its `EngineClient` contract: its `InputProcessor` (facts, chat template, the request checks, which build the
`EngineRequest`), `submit`, and the `EngineOutput` deltas of its streams, which the responses append."""
from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedlm.engine.client import EngineClient, RequestStream
from pagedlm.engine.errors import EngineError
from pagedlm.engine.protocol import CompletionDelta, EngineOutput, EngineRequest
from pagedlm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedlm.sampling.detokenizer import held_back
from pagedlm.sampling.params import SamplingParams
from pagedlm.server import protocol as P
from pagedlm.server.errors import api_error
from pagedlm.server.limits import RequestLimits, check_fan_out, check_prompt_logprobs
from pagedlm.server.protocol import APIError
from pagedlm.server.stages import StagePools
from pagedlm.server.streaming import (
    ChoiceState,
    EventStream,
    StreamUsage,
    abort_all,
    collect,
    event,
    final_usage,
    first_outputs,
    merge,
)
from pagedlm.server.tokenizing import TokenizerEndpoints
from pagedlm.server.tools import HermesToolParser
from pagedlm.server.wire import json_response


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None = None  # the text the client sent, if it sent text
    echo_logprobs: tuple[P.CompletionLogprobs, int] | None = None  # echo's logprobs and text length, made once


class ModelServer(TokenizerEndpoints):
    """One served model: its requests, after the model is resolved (tokenizer, template, limits are its own).
    `routed` requests also wait, when streaming, for the first outputs before the response starts, so that a
    failure then is still `Unavailable`."""

    def __init__(self, engine: EngineClient, name: str, max_prompts_per_request: int = 256,
                 prefix_cache_per_key: bool = False, tool_parser: HermesToolParser | None = None,
                 limits: RequestLimits = RequestLimits(), stages: StagePools | None = None) -> None:
        self.engine, self.name, self.limits = engine, name, limits
        self.stages = stages or StagePools()
        self.processor, self.tool_parser, self.created = engine.input_processor, tool_parser, int(time.time())
        self.tok = self.processor.tokenizer
        self.max_prompts_per_request, self.prefix_cache_per_key = max_prompts_per_request, prefix_cache_per_key

    def _cache_salt(self, request: Request, req: P.SamplingRequest) -> str | None:
        """The client's `cache_salt`, prefixed (with --prefix-cache-per-key) by a hash of its API key."""
        key = getattr(request.state, "api_key", None) if self.prefix_cache_per_key else None
        if key is None:
            return req.cache_salt
        tenant = hashlib.sha256(key.encode()).hexdigest()[:32]
        return tenant if req.cache_salt is None else f"{tenant}:{req.cache_salt}"

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(id=self.name, created=self.created, root=self.processor.model_path.name,
                           max_model_len=self.processor.max_model_len)

    # --- completions ---
    async def completions(self, request: Request, req: P.CompletionRequest, arrival: float,
                          routed: bool = False, rid: str | None = None) -> Response:
        prompts = await self._completion_prompts(req)
        k = req.logprobs
        params = req.sampling_params(req.max_tokens, logprobs=k, prompt_logprobs=req.prompt_logprobs
                                     if req.prompt_logprobs is not None else k if req.echo else None)
        copies = (req.prompt_logprobs is not None) + (req.echo and k is not None)
        check_prompt_logprobs([len(p.token_ids) for p in prompts], params, params.n * copies)
        self.limits.check_logprobs([len(p.token_ids) for p in prompts], params, self.processor.max_model_len)
        self._check_params([len(p.token_ids) for p in prompts], params)
        await self._prepare(req, params)
        rid = rid or f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, prompts, params, req.priority, arrival, self._cache_salt(request, req))
        if req.stream:
            return await self._event_stream(request, streams, routed,
                                            self._completion_events(req, rid, prompts, streams, params))
        finals = await collect(request, streams)
        choices = [self._completion_choice(i * params.n + o.index, req, params, prompt, out, o, ChoiceState())
                   for i, (prompt, out) in enumerate(zip(prompts, finals)) for o in out.outputs]
        if req.prompt_logprobs is not None:
            converted = [_prompt_logprobs(out) for out in finals]  # once per prompt, whatever n
            for c in choices:
                c.prompt_logprobs = converted[c.index // params.n]
        return json_response(P.CompletionResponse(id=rid, model=self.name, choices=choices,
                                                  usage=final_usage(finals, params)))

    async def _completion_prompts(self, req: P.CompletionRequest) -> list[_Prompt]:
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "The prompt is empty.", param="prompt")
        if len(prompt) > self.engine.max_waiting:
            raise APIError(400, f"A request may hold at most {self.engine.max_waiting} prompts.", param="prompt")
        check_fan_out(len(prompt), req, self.max_prompts_per_request)
        self.limits.check_text_prompts(prompt)
        tokenized = await self.stages.run("tokenize", lambda: [self.processor.tokenize(p) for p in prompt])
        out = [_Prompt(ids, text) for text, ids in tokenized]
        for p in out:
            self._check_prompt(p.token_ids)
        return out

    def _check_prompt(self, ids: list[int]) -> None:
        try:
            self.processor.check_prompt(ids)
        except EngineError as e:
            raise api_error(e) from None

    def _check_params(self, prompt_lens: list[int], params: SamplingParams) -> None:
        """The engine's limits, and admission: refuse what the engine could never finish even alone."""
        try:
            self.processor.check_params(params, prompt_lens)
        except EngineError as e:
            raise api_error(e) from None

    def _echo_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tok.decode(prompt.token_ids, skip_special_tokens=False)

    def _completion_choice(self, index: int, req: P.CompletionRequest, params: SamplingParams, prompt: _Prompt,
                           out: RequestOutput | EngineOutput, o: CompletionOutput | CompletionDelta,
                           state: ChoiceState) -> P.CompletionChoice:
        """The choice for `o`: a whole sample (of a RequestOutput), or what a streamed delta adds; echo first (the
        prompt logprobs come with the request's first output)."""
        state.done = o.finish_reason is not None
        text = o.text
        echo, state.echoed = req.echo and not state.echoed, True
        logprobs = None
        if req.logprobs is not None:
            logprobs = P.CompletionLogprobs()
            if echo:
                if prompt.echo_logprobs is None:  # the same for every choice: converted once
                    head = P.CompletionLogprobs()
                    entries = out.prompt_logprobs or [None] * len(prompt.token_ids)
                    prompt.echo_logprobs = head, self._add_completion_logprobs(head, prompt.token_ids, entries, 0)
                head, state.text_offset = prompt.echo_logprobs
                logprobs = P.CompletionLogprobs(tokens=list(head.tokens), token_logprobs=list(head.token_logprobs),
                                                top_logprobs=list(head.top_logprobs),
                                                text_offset=list(head.text_offset))
            state.text_offset = self._add_completion_logprobs(logprobs, o.token_ids, o.logprobs or [],
                                                              state.text_offset)
        if echo:
            text = self._echo_text(prompt) + text
        return P.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=o.finish_reason if state.done else None,
                                  stop_reason=o.stop_reason if state.done else None)

    def _add_completion_logprobs(self, lp: P.CompletionLogprobs, token_ids: list[int],
                                 entries: list[PositionLogprobs | None], offset: int) -> int:
        for tid, entry in zip(token_ids, entries):
            if entry is None:
                token = self.tok.decode([tid], skip_special_tokens=False)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                token = _token_str(self, tid, entry)
                lp.token_logprobs.append(_clamp(entry[tid].logprob))
                lp.top_logprobs.append({_token_str(self, t, entry): _clamp(e.logprob) for t, e in entry.items()})
            lp.tokens.append(token)
            lp.text_offset.append(offset)
            offset += len(token)
        return offset

    async def _completion_events(self, req: P.CompletionRequest, rid: str, prompts: list[_Prompt],
                                 streams: list[RequestStream], params: SamplingParams) -> AsyncIterator[str]:
        created, n = int(time.time()), params.n
        states = [ChoiceState() for _ in range(len(prompts) * n)]
        usage = StreamUsage([len(p.token_ids) for p in prompts], params)
        async for i, out in merge(streams):
            usage.add(i, out)
            for o in out.outputs:
                st = states[i * n + o.index]
                if st.done:
                    continue
                choice = self._completion_choice(i * n + o.index, req, params, prompts[i], out, o, st)
                if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                    yield event(P.CompletionResponse(id=rid, created=created, model=self.name, choices=[choice],
                                                      usage=usage.info() if req.continuous_usage and
                                                      req.include_usage else None))
        if req.include_usage:
            yield event(P.CompletionResponse(id=rid, created=created, model=self.name, choices=[],
                                              usage=usage.info()))

    # --- chat ---
    async def chat_completions(self, request: Request, req: P.ChatCompletionRequest, arrival: float,
                               routed: bool = False, rid: str | None = None) -> Response:
        check_fan_out(1, req, self.max_prompts_per_request)
        if req.tools_active and self.tool_parser is None:
            raise APIError(400, "This server does not parse tool calls (start it with --tool-call-parser).",
                           param="tools")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools_active else None
        ids = await self.stages.run("chat", self.chat_request_prompt, req, tools)
        self._check_prompt(ids)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, logprobs=k,
                                     prompt_logprobs=req.prompt_logprobs)
        functions = req.called_functions()
        if functions is not None:  # tool_choice "required" or a named function: the decoder enforces the calls
            parallel = req.parallel_tool_calls and not isinstance(req.tool_choice, P.NamedToolChoice)
            try:
                params.structured_outputs = self.tool_parser.call_grammar(functions, parallel)
            except ValueError as e:
                raise APIError(400, f"The tools' call grammar: {e}", param="tools") from None
        check_prompt_logprobs([len(ids)], params, 1)
        self.limits.check_logprobs([len(ids)], params, self.processor.max_model_len)
        self._check_params([len(ids)], params)
        await self._prepare(req, params)
        rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, [_Prompt(ids)], params, req.priority, arrival,
                                     self._cache_salt(request, req))
        if req.stream:
            return await self._event_stream(request, streams, routed,
                                            self._chat_events(req, rid, streams, params, len(ids)))
        (out,) = await collect(request, streams)
        choices = []
        for o in out.outputs:
            message, finish = P.AssistantMessage(content=o.text), o.finish_reason
            if req.tools_active:
                content, calls = self.tool_parser.parse(o.text)
                if calls:
                    message = P.AssistantMessage(content=content, tool_calls=[
                        P.ToolCall(id=c.id, function=P.FunctionCall(name=c.name, arguments=c.arguments))
                        for c in calls])
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append(P.ChatChoice(
                index=o.index, message=message, finish_reason=finish, stop_reason=o.stop_reason,
                logprobs=self._chat_logprobs(o.token_ids, o.logprobs, k) if k is not None else None))
        return json_response(P.ChatCompletionResponse(
            id=rid, model=self.name, choices=choices, usage=final_usage([out], params),
            prompt_logprobs=_prompt_logprobs(out) if req.prompt_logprobs is not None else None))

    def _chat_logprobs(self, token_ids: list[int], entries: list[PositionLogprobs] | None,
                       k: int) -> P.ChatLogprobs:
        content = []
        for tid, entry in zip(token_ids, entries or []):
            token = _token_str(self, tid, entry)
            top = sorted((e.rank, t, e) for t, e in entry.items() if e.rank is not None and e.rank <= k)[:k]
            content.append(P.ChatLogprob(
                token=token, logprob=_clamp(entry[tid].logprob), bytes=list(token.encode()),
                top_logprobs=[P.TopLogprob(token=(s := _token_str(self, t, entry)), logprob=_clamp(e.logprob),
                                           bytes=list(s.encode())) for _, t, e in top]))
        return P.ChatLogprobs(content=content)

    async def _chat_events(self, req: P.ChatCompletionRequest, rid: str, streams: list[RequestStream],
                           params: SamplingParams, prompt_len: int) -> AsyncIterator[str]:
        created, n = int(time.time()), params.n
        k = (req.top_logprobs or 0) if req.logprobs else None
        states = [ChoiceState() for _ in range(n)]
        usage = StreamUsage([prompt_len], params)

        def chunk(index: int, delta: P.DeltaMessage, **kw: Any) -> str:
            return event(P.ChatCompletionChunk(id=rid, created=created, model=self.name,
                                                usage=usage.info() if req.continuous_usage and req.include_usage
                                                else None,
                                                choices=[P.ChatStreamChoice(index=index, delta=delta, **kw)]))

        for j in range(n):
            yield chunk(j, P.DeltaMessage(role="assistant", content=""))
        async for _, out in merge(streams):
            usage.add(0, out)
            for o in out.outputs:
                st = states[o.index]
                if st.done:
                    continue
                if req.tools_active:
                    for ev in self._tool_events(st, o, chunk):
                        yield ev
                    continue
                st.done = o.finish_reason is not None
                lps = self._chat_logprobs(o.token_ids, o.logprobs, k) if k is not None and o.token_ids else None
                if o.text or lps:
                    yield chunk(o.index, P.DeltaMessage(content=o.text), logprobs=lps)
                if st.done:
                    yield chunk(o.index, P.DeltaMessage(), finish_reason=o.finish_reason, stop_reason=o.stop_reason)
        if req.include_usage:
            yield event(P.ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[],
                                               usage=usage.info()))

    def _tool_events(self, st: ChoiceState, o: CompletionDelta, chunk: Callable[..., str]) -> list[str]:
        """Stream events of one choice when tools are offered: content up to the first tool call as it comes
        (a possible start of `<tool_call>` held back; stop strings are the engine's), then, once the output is
        complete, its calls in one `delta.tool_calls` and finish_reason "tool_calls"."""
        parser = self.tool_parser
        st.text += o.text  # the whole answer: its calls are parsed at the end
        text = st.text
        st.done = o.finish_reason is not None
        cut = text.find(parser.start, max(0, st.sent_chars - len(parser.start) + 1))
        events = []
        if not st.done:
            end = cut if cut != -1 else len(text) - held_back(text, [parser.start])
            end = max(end, st.sent_chars)
            if end > st.sent_chars:
                events.append(chunk(o.index, P.DeltaMessage(content=text[st.sent_chars:end])))
                st.sent_chars = end
            return events
        _, calls = parser.parse(text)
        rest = text[st.sent_chars:cut] if calls else text[st.sent_chars:]
        if rest:
            events.append(chunk(o.index, P.DeltaMessage(content=rest)))
        finish = o.finish_reason
        if calls:
            events.append(chunk(o.index, P.DeltaMessage(tool_calls=[
                P.DeltaToolCall(index=i, id=c.id, type="function",
                                function=P.DeltaFunctionCall(name=c.name, arguments=c.arguments))
                for i, c in enumerate(calls)])))
            finish = "tool_calls" if finish == "stop" else finish
        events.append(chunk(o.index, P.DeltaMessage(), finish_reason=finish, stop_reason=o.stop_reason))
        return events

    async def _prepare(self, req: P.SamplingRequest, params: SamplingParams) -> None:
        """Token controls checked against the vocabulary (tokenize stage) and the constraint compiled (grammar stage,
        kept on `params`) on worker threads, so that the engine thread finds it compiled; 400 naming the field (a
        constraint's: the request field it came from)."""
        try:
            stage = "tokenize" if params.structured_outputs is None else "grammar"
            await self.stages.run(stage, self.processor.prepare_params, params)
        except EngineError as e:
            raise api_error(e, _constraint_field(req) if e.param == "structured_outputs" else None) from None

    # --- submission ---
    async def _submit(self, rid: str, prompts: list[_Prompt], params: SamplingParams, priority: int,
                      arrival: float, cache_salt: str | None = None) -> list[RequestStream]:
        """Queue every prompt or none: on any refusal the accepted ones are aborted and the error raised."""
        ids = request_ids(rid, len(prompts))
        streams = [self.engine.submit(EngineRequest(i, p.token_ids, params, p.text, arrival, priority, cache_salt))
                   for i, p in zip(ids, prompts)]
        try:
            results = await asyncio.gather(*(s.accepted() for s in streams), return_exceptions=True)
        except BaseException:
            abort_all(streams)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return streams
        abort_all(streams)
        e = errors[0]
        raise api_error(e) if isinstance(e, EngineError) else e

    async def _event_stream(self, request: Request, streams: list[RequestStream], routed: bool,
                            events: AsyncIterator[str]) -> EventStream:
        """The SSE response of `events`; a routed request first waits for its first outputs (see the class)."""
        if routed:
            await first_outputs(request, streams)
        return EventStream(events, streams, self.engine.stall_timeout)

def _constraint_field(req: P.SamplingRequest) -> str | None:
    """The request field an output constraint came from (tools: the call grammar of a forced tool choice)."""
    fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "tools")
    return next((f for f in fields if getattr(req, f, None) is not None), None)


def _prompt_logprobs(out: RequestOutput) -> list[dict[str, P.PromptLogprob] | None]:
    return [None if entry is None else {str(t): P.PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank,
                                                                decoded_token=lp.decoded_token)
                                        for t, lp in entry.items()}
            for entry in out.prompt_logprobs or []]


def _token_str(srv: ModelServer, tid: int, entry: PositionLogprobs) -> str:
    lp = entry.get(tid)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return srv.tok.decode([tid], skip_special_tokens=False)


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0) if logprob == logprob else -9999.0


def request_ids(rid: str, num_prompts: int) -> list[str]:
    """The engine request ids of a request `rid` with `num_prompts` prompts."""
    return [rid] if num_prompts == 1 else [f"{rid}-{i}" for i in range(num_prompts)]

