"""POST /v1/completions for one served model: text or token-id prompts (several per request), echo, completion
logprobs and prompt logprobs; the answer whole (`Answer`) or as each delta adds to a choice (`Stream`)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request

from pagedlm.engine.client import RequestStream
from pagedlm.engine.protocol import CompletionDelta, EngineOutput
from pagedlm.outputs import CompletionOutput, RequestOutput
from pagedlm.sampling.params import SamplingParams
from pagedlm.server import protocol as P
from pagedlm.server.endpoints import logprobs as L
from pagedlm.server.endpoints.base import EndpointBase, Prompt
from pagedlm.server.endpoints.results import Answer, Result
from pagedlm.server.limits import check_fan_out
from pagedlm.server.protocol import APIError
from pagedlm.server.streaming import ChoiceState, StreamUsage, collect, final_usage, merge


class CompletionsEndpoint(EndpointBase):
    async def completions(self, request: Request, req: P.CompletionRequest, arrival: float,
                          routed: bool = False, rid: str | None = None) -> Result:
        prompts = await self._completion_prompts(req)
        k = req.logprobs
        params = req.sampling_params(req.max_tokens, logprobs=k, prompt_logprobs=req.prompt_logprobs
                                     if req.prompt_logprobs is not None else k if req.echo else None)
        copies = (req.prompt_logprobs is not None) + (req.echo and k is not None)
        await self.check_and_prepare(request, req, params, [len(p.token_ids) for p in prompts], params.n * copies)
        rid = rid or f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request, req, rid, prompts, params, arrival)
        if req.stream:
            chunks = self._completion_chunks(req, rid, prompts, streams, params)
            return await self.stream(request, streams, routed, chunks)
        finals = await collect(request, streams)

        def answer() -> P.CompletionResponse:
            for prompt, out in zip(prompts, finals):
                self._convert_prompt(req, prompt, out)
            choices = [self._completion_choice(i * params.n + o.index, req, prompt, out, o, ChoiceState())
                       for i, (prompt, out) in enumerate(zip(prompts, finals)) for o in out.outputs]
            for c in choices:
                c.prompt_logprobs = prompts[c.index // params.n].prompt_logprobs
            return P.CompletionResponse(id=rid, model=self.name, choices=choices, usage=final_usage(finals, params))

        # with logprobs, the answer is built on the render stage's threads, not on the event loop
        return Answer(await self.stages.run("render", answer) if _with_logprobs(req) else answer())

    async def _completion_prompts(self, req: P.CompletionRequest) -> list[Prompt]:
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
        out = [Prompt(ids, text) for text, ids in tokenized]
        for p in out:
            self.check_prompt(p.token_ids)
        return out

    def _completion_echo(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tok.decode(prompt.token_ids, skip_special_tokens=False)

    def _completion_choice(self, index: int, req: P.CompletionRequest, prompt: Prompt,
                           out: RequestOutput | EngineOutput, o: CompletionOutput | CompletionDelta,
                           state: ChoiceState) -> P.CompletionChoice:
        """The choice for `o`: a whole sample (of a RequestOutput), or what a streamed delta adds; echo first, and
        the prompt's logprobs, both as `_convert_prompt` made them from the request's first output."""
        state.done = o.finish_reason is not None
        text = o.text
        echo, state.echoed = req.echo and not state.echoed, True
        logprobs = None
        if req.logprobs is not None:
            logprobs = P.CompletionLogprobs()
            if echo:
                head, state.text_offset = prompt.echo_logprobs
                logprobs = P.CompletionLogprobs(tokens=list(head.tokens), token_logprobs=list(head.token_logprobs),
                                                top_logprobs=list(head.top_logprobs),
                                                text_offset=list(head.text_offset))
            state.text_offset = L.add_completion(self.tok, logprobs, o.token_ids, o.logprobs or [],
                                                 state.text_offset, req.return_tokens_as_token_ids)
        if echo:
            text = self._completion_echo(prompt) + text
        return P.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=o.finish_reason if state.done else None,
                                  stop_reason=o.stop_reason if state.done else None)

    def _convert_prompt(self, req: P.CompletionRequest, prompt: Prompt, out: RequestOutput | EngineOutput) -> None:
        """What a response shows of the prompt's logprobs (`out`: the prompt's first or whole output), made once
        per prompt whatever n: echo's completion logprobs, and vLLM's prompt_logprobs."""
        if req.echo and req.logprobs is not None and prompt.echo_logprobs is None:
            head = P.CompletionLogprobs()
            entries = out.prompt_logprobs or [None] * len(prompt.token_ids)
            prompt.echo_logprobs = head, L.add_completion(self.tok, head, prompt.token_ids, entries, 0,
                                                          req.return_tokens_as_token_ids)
        if req.prompt_logprobs is not None and prompt.prompt_logprobs is None:
            prompt.prompt_logprobs = L.prompt(out)

    async def _completion_chunks(self, req: P.CompletionRequest, rid: str, prompts: list[Prompt],
                      streams: list[RequestStream], params: SamplingParams) -> AsyncIterator[P.CompletionResponse]:
        created, n = int(time.time()), params.n
        states = [ChoiceState() for _ in range(len(prompts) * n)]
        usage = StreamUsage([len(p.token_ids) for p in prompts], params)
        echo = req.echo and req.logprobs is not None
        async for i, out in merge(streams):
            usage.add(i, out)
            if echo and prompts[i].echo_logprobs is None:  # the prompt's first output: its logprobs, off the loop
                await self.stages.run("render", self._convert_prompt, req, prompts[i], out)
            for o in out.outputs:
                st = states[i * n + o.index]
                if st.done:
                    continue
                choice = self._completion_choice(i * n + o.index, req, prompts[i], out, o, st)
                if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                    yield P.CompletionResponse(id=rid, created=created, model=self.name, choices=[choice],
                                               usage=usage.info() if req.continuous_usage and req.include_usage
                                               else None)
        if req.include_usage:
            yield P.CompletionResponse(id=rid, created=created, model=self.name, choices=[], usage=usage.info())


def _with_logprobs(req: P.CompletionRequest) -> bool:
    return req.logprobs is not None or req.prompt_logprobs is not None
