"""What every OpenAI endpoint of one served model shares, once its model is resolved: its engine (seen only through
the `EngineClient` contract), tokenizer, chat template and limits; the prompt's checks (a chat's messages rendered
and bounded, token ids against the vocabulary and the context), the checks that bound a request's work and its
params prepared on worker threads, submission (every prompt's `EngineRequest`, or none), and a streamed answer's
`Stream`. Each engine error becomes its OpenAI error (server/errors.py)."""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from pagedlm.engine.client import EngineClient, RequestStream
from pagedlm.engine.errors import ChatTemplateError, EngineError
from pagedlm.engine.protocol import EngineRequest
from pagedlm.sampling.params import SamplingParams
from pagedlm.server import protocol as P
from pagedlm.server.endpoints.results import Chunk, Stream
from pagedlm.server.errors import api_error
from pagedlm.server.limits import LogprobBudget, RequestLimits, check_prompt_logprobs
from pagedlm.server.protocol import APIError
from pagedlm.server.response_models import PromptLogprobs
from pagedlm.server.stages import StagePools
from pagedlm.server.streaming import abort_all, first_outputs
from pagedlm.server.tools import HermesToolParser

TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort"})  # template variables a request sets
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "tools")  # where an output constraint may come from (tools: a forced call)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the text the client sent, if it sent text
    echo_logprobs: tuple[P.CompletionLogprobs, int] | None = None  # echo's logprobs and text length, made once
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's prompt_logprobs, made once


def request_ids(rid: str, num_prompts: int) -> list[str]:
    """The engine request ids of a request `rid` with `num_prompts` prompts."""
    return [rid] if num_prompts == 1 else [f"{rid}-{i}" for i in range(num_prompts)]


class EndpointBase:
    """One served model: its engine, tokenizer, template and limits, and the steps its endpoints share.
    `routed` requests (placed by the auto model) also wait, when streaming, for the first outputs before the
    response starts, so that a failure then is still `Unavailable` and another model may take the request."""

    tool_template: str | None = None  # the template requests with tools are rendered with (None: the model's)
    auto_tool_choice: bool = True  # tool_choice "auto" is served (--enable-auto-tool-choice)

    def __init__(self, engine: EngineClient, name: str, max_prompts_per_request: int = 256,
                 prefix_cache_per_key: bool = False, tool_parser: HermesToolParser | None = None,
                 limits: RequestLimits = RequestLimits(), stages: StagePools | None = None,
                 logprob_budget: LogprobBudget | None = None) -> None:
        self.engine, self.name, self.limits = engine, name, limits
        self.stages = stages or StagePools()
        self.logprob_budget = logprob_budget or LogprobBudget(0)  # the app's, shared by its models
        self.processor, self.tool_parser, self.created = engine.input_processor, tool_parser, int(time.time())
        self.tok = self.processor.tokenizer
        self.max_prompts_per_request, self.prefix_cache_per_key = max_prompts_per_request, prefix_cache_per_key

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(id=self.name, created=self.created, root=self.processor.model_path.name,
                           max_model_len=self.processor.max_model_len)

    # --- prompts ---
    def chat_prompt(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """The prompt's token ids, as the engine's chat template renders the messages (InputProcessor.render_chat)."""
        text = self.render_chat(messages, add_generation_prompt, tools, template_kwargs, continue_final_message)
        return self.tok.encode(text, add_special_tokens=False)

    def chat_request_prompt(self, req: P.ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        """A chat request's prompt: its messages, tools and chat_template_kwargs (only TEMPLATE_KWARGS: 400 for
        others, which could change how the template is applied rather than what it writes)."""
        kwargs = req.chat_template_kwargs or {}
        bad = sorted(set(kwargs) - TEMPLATE_KWARGS)
        if bad:
            raise APIError(400, f"chat_template_kwargs may set {', '.join(sorted(TEMPLATE_KWARGS))}, not "
                                f"{', '.join(bad)}.", param="chat_template_kwargs")
        return self.chat_prompt(req.messages, req.add_generation_prompt, tools, kwargs, req.continue_final_message)

    def render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    continue_final_message: bool = False) -> str:
        """400 beyond the bounds of `limits` (RequestLimits): the message count before the template runs, the
        rendered characters before anything tokenizes them."""
        self.limits.check_messages(len(messages))
        try:
            text = self.processor.render_chat([m.template_message() for m in messages], add_generation_prompt,
                                              tools, self.tool_template if tools else None, template_kwargs,
                                              continue_final_message)
        except ChatTemplateError as e:
            raise api_error(e) from None
        self.limits.check_prompt_chars(text, "messages")
        return text

    def check_prompt(self, ids: list[int]) -> None:
        """400 for a prompt outside the vocabulary, empty, or leaving no room in the context."""
        try:
            self.processor.check_prompt(ids)
        except EngineError as e:
            raise api_error(e) from None

    # --- the request's work ---
    async def check_and_prepare(self, request: Request, req: P.SamplingRequest, params: SamplingParams,
                                prompt_lens: list[int], prompt_logprob_copies: int) -> None:
        """The checks that bound the work: the response's prompt logprobs (`prompt_logprob_copies` per prompt),
        the generated logprobs kept, the engine's limits and admission (could it ever finish, even alone?); the
        logprobs it keeps taken from the server's budget (429 while others hold it; held until the response has
        ended: the request's `holds`). Then token controls checked against the vocabulary (tokenize stage) and
        the constraint compiled (grammar stage, kept on `params`) on worker threads, so that the engine thread
        finds it compiled; 400 naming the field (a constraint's: the request field it came from)."""
        check_prompt_logprobs(prompt_lens, params, prompt_logprob_copies)
        kept = self.limits.check_logprobs(prompt_lens, params, self.processor.max_model_len)
        try:
            self.processor.check_params(params, prompt_lens)
        except EngineError as e:
            raise api_error(e) from None
        holds = getattr(request.state, "holds", None)  # set by the middleware (Guard), which releases them
        if holds is not None:
            self.logprob_budget.take(kept, holds, "logprobs" if params.logprobs is not None else "prompt_logprobs")
        try:
            stage = "tokenize" if params.structured_outputs is None else "grammar"
            await self.stages.run(stage, self.processor.prepare_params, params)
        except EngineError as e:
            field = next((f for f in CONSTRAINT_FIELDS if getattr(req, f, None) is not None), None)
            raise api_error(e, field if e.param == "structured_outputs" else None) from None

    def cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The client's `cache_salt`, prefixed (with --prefix-cache-per-key) by a hash of its API key."""
        key = getattr(request.state, "api_key", None) if self.prefix_cache_per_key else None
        if key is None:
            return salt
        tenant = hashlib.sha256(key.encode()).hexdigest()[:32]
        return tenant if salt is None else f"{tenant}:{salt}"

    async def submit(self, request: Request, req: P.SamplingRequest, rid: str, prompts: list[Prompt],
                     params: SamplingParams, arrival: float) -> list[RequestStream]:
        """Queue every prompt or none: on any refusal the accepted ones are aborted and the error raised."""
        salt = self.cache_salt(request, req.cache_salt)
        return await self.submit_requests([EngineRequest(i, p.token_ids, params, p.text, arrival, req.priority, salt)
                                           for i, p in zip(request_ids(rid, len(prompts)), prompts)])

    async def submit_requests(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Queue every request or none (`submit`'s rule)."""
        streams = [self.engine.submit(r) for r in requests]
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

    async def stream(self, request: Request, streams: list[RequestStream], routed: bool,
                     chunks: AsyncIterator[Chunk]) -> Stream:
        """The streamed answer of `chunks`; a routed request first waits for its first outputs (see the class)."""
        if routed:
            await first_outputs(request, streams)
        return Stream(chunks, streams, self.engine.stall_timeout)
