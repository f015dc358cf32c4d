"""The frontend of generation requests: each request is parsed (its unknown fields flagged or refused), admitted
(priority, its key's cap) and its model resolved to its `ServedModel` (endpoints/), whose typed result it renders
(endpoints/render.py); a request for the auto model's name goes to the `AutoModel` (auto.py) instead. Chat answers
get their reasoning split out (--reasoning-parser) last, whichever model answered."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagedlm.server import protocol as P
from pagedlm.server.auto import AutoModel
from pagedlm.server.dispatch import Dispatcher
from pagedlm.server.endpoints import ServedModel, render
from pagedlm.server.metrics import ServerMetrics
from pagedlm.server.protocol import APIError, shutting_down
from pagedlm.server.reasoning import ThinkParser, split_reasoning
from pagedlm.server.wire import header_text, parse_request

UNKNOWN_FIELDS_HEADER = "x-pagedlm-unknown-fields"


class Frontend:
    """Resolves each request's model: a served one, or (for the dispatcher's name) the auto model."""

    def __init__(self, models: dict[str, ServedModel], metrics: ServerMetrics, dispatcher: Dispatcher | None,
                 strict_request_fields: bool = False, allow_client_priority: bool = False) -> None:
        self.models, self.dispatcher = models, dispatcher
        self.auto = AutoModel(dispatcher, models, metrics) if dispatcher is not None else None
        self.stages = next(iter(models.values())).stages  # the app's, shared by its models
        self.strict_request_fields, self.allow_client_priority = strict_request_fields, allow_client_priority
        self.default = next(iter(models.values()))
        self.created = int(time.time())
        self.draining = False  # set by a graceful shutdown: new generation requests get 503
        self.reasoning: ThinkParser | None = None  # --reasoning-parser: chat answers get reasoning_content
        self.thinking_token_budget: int | None = None  # --thinking-token-budget: chat requests' default

    def begin_shutdown(self) -> None:
        self.draining = True

    def fail_open_requests(self, message: str) -> None:
        """End every open request with an error (streams get an error event and [DONE])."""
        for m in self.models.values():
            m.engine.fail_all(message)

    @property
    def num_open_requests(self) -> int:
        return sum(m.engine.num_open_requests for m in self.models.values())

    def model(self, name: str | None) -> ServedModel:
        """The served model `name` (none: the first); 404 for a name not served (the auto model's included)."""
        if not name:
            return self.default
        m = self.models.get(name)
        if m is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return m

    def is_auto(self, name: str | None) -> bool:
        return self.dispatcher is not None and name == self.dispatcher.name

    def model_cards(self) -> list[P.ModelCard]:
        cards = [m.model_card() for m in self.models.values()]
        if self.auto is not None:
            cards.append(self.auto.model_card(self.created))
        return cards

    def model_card(self, name: str) -> P.ModelCard:
        return self.auto.model_card(self.created) if self.is_auto(name) else self.model(name).model_card()

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        if self.draining:
            raise shutting_down()
        req = await parse_request(request, P.CompletionRequest, self.stages)
        unknown = self.unknown_fields(req)
        return flag_unknown(await self.complete(request, req, arrival), unknown)

    async def complete(self, request: Request, req: P.CompletionRequest, arrival: float) -> Response:
        """A parsed completion request (from /v1/completions or translated from Ollama's raw /api/generate), as
        `chat` runs a chat request."""
        if self.draining:
            raise shutting_down()
        self._admit(request, req, _num_prompts(req.prompt))
        if not self.is_auto(req.model):
            model = self.model(req.model)
            req.check_supported()
            return render(await model.completions(request, req, arrival))
        req.check_supported()
        return await self.auto.complete(request, req, arrival)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        if self.draining:
            raise shutting_down()
        req = await parse_request(request, P.ChatCompletionRequest, self.stages)
        unknown = self.unknown_fields(req)
        return flag_unknown(await self.chat(request, req, arrival), unknown)

    async def chat(self, request: Request, req: P.ChatCompletionRequest, arrival: float) -> Response:
        """A parsed chat request, from /v1/chat/completions or translated from another API (Ollama, Anthropic,
        Responses): the key's cap, the checks, then its model's `chat_completions` (the auto model's `chat` for
        its name). Its answer is OpenAI's chat response or SSE stream."""
        if self.draining:
            raise shutting_down()
        self._admit(request, req, 1)
        self._budget(req)
        if not self.is_auto(req.model):
            model = self.model(req.model)
            req.check_supported()
            return self._reasoned(render(await model.chat_completions(request, req, arrival)))
        req.check_supported()
        return self._reasoned(await self.auto.chat(request, req, arrival))

    def _budget(self, req: P.ChatCompletionRequest) -> None:
        """The request's thinking budget (else the server's default), with the reasoning parser's tags; 400 for a
        budget on a server without a reasoning parser (it knows no tags)."""
        if req.thinking_token_budget is None:
            req.thinking_token_budget = self.thinking_token_budget
        if req.thinking_token_budget is None:
            return
        if self.reasoning is None:
            raise APIError(400, "thinking_token_budget needs a reasoning parser (start the server with "
                                "--reasoning-parser).", param="thinking_token_budget")
        req.reasoning_tags = self.reasoning.tags

    def _reasoned(self, response: Response) -> Response:
        return response if self.reasoning is None else split_reasoning(response, self.reasoning)

    def _admit(self, request: Request, req: P.SamplingRequest, num_prompts: int) -> None:
        """400 for a client-set priority unless allowed; the request's prompts taken from its key's cap (429
        beyond it; given back by the middleware when the response has ended)."""
        if req.priority and not self.allow_client_priority:
            raise APIError(400, "`priority` is set by the server's policy here (start it with "
                                "--allow-client-priority to let requests set it).", param="priority")
        lease = getattr(request.state, "key_lease", None)
        if lease is not None:
            lease.take(num_prompts)

    def unknown_fields(self, req: BaseModel) -> list[str]:
        """The request's fields this server does not know; with --strict-request-fields they are a 400."""
        unknown = _extra_fields(req)
        if unknown and self.strict_request_fields:
            raise APIError(400, f"Unknown request fields: {', '.join(unknown)} (the server runs with "
                                "--strict-request-fields).", param=unknown[0], code="unknown_fields")
        return unknown


def _extra_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields `model` (and the models inside it) let through unparsed, without duplicates."""
    found = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                found += _extra_fields(item, f"{prefix}{name}.")
    return list(dict.fromkeys(found))


def flag_unknown(response: Response, unknown: list[str]) -> Response:
    if unknown:
        response.headers[UNKNOWN_FIELDS_HEADER] = header_text(",".join(unknown), limit=1024)
    return response


def _num_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
