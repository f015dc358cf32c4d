"""Model resolution and routing: each request's model is resolved to its `ModelServer`; a request for the
`Dispatcher`'s name (the auto model) is routed, with fallback (a model that refuses, fails or is down before anything reached the
client is replaced by the router's fallback) and, under a cascade policy, answered by the weak model first."""
from __future__ import annotations

import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pagedlm.router import BudgetExceededError, CascadePolicy, Decision, NoCandidateError, WeakAnswer
from pagedlm.server import protocol as P
from pagedlm.server.metrics import ServerMetrics
from pagedlm.server.openai_handlers import ModelServer, request_ids
from pagedlm.server.protocol import RETRY_AFTER_S, APIError, Unavailable, shutting_down
from pagedlm.server.reasoning import ThinkParser, split_reasoning
from pagedlm.server.dispatch import Dispatcher
from pagedlm.server.streaming import DONE, event
from pagedlm.server.wire import parse_request

logger = logging.getLogger(__name__)

D = TypeVar("D")
UNKNOWN_FIELDS_HEADER = "x-pagedlm-unknown-fields"


class Frontend:
    """Resolves each request's model and, for the route name, routes it (with fallback)."""

    def __init__(self, servers: dict[str, ModelServer], metrics: ServerMetrics, route: Dispatcher | None,
                 strict_request_fields: bool = False, allow_client_priority: bool = False) -> None:
        self.servers, self.metrics, self.route = servers, metrics, route
        self.stages = next(iter(servers.values())).stages  # the app's, shared by its models
        self.strict_request_fields, self.allow_client_priority = strict_request_fields, allow_client_priority
        self.default = next(iter(servers.values()))
        self.created = int(time.time())
        self.draining = False  # set by a graceful shutdown: new generation requests get 503
        self.reasoning: ThinkParser | None = None  # --reasoning-parser: chat answers get reasoning_content

    def begin_shutdown(self) -> None:
        self.draining = True

    def fail_open_requests(self, message: str) -> None:
        """End every open request with an error (streams get an error event and [DONE])."""
        for srv in self.servers.values():
            srv.engine.fail_all(message)

    @property
    def num_open_requests(self) -> int:
        return sum(srv.engine.num_open_requests for srv in self.servers.values())

    def server(self, model: str | None) -> ModelServer:
        if not model:
            return self.default
        srv = self.servers.get(model)
        if srv is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return srv

    def is_routed(self, model: str | None) -> bool:
        return self.route is not None and model == self.route.name

    def model_cards(self) -> list[P.ModelCard]:
        cards = [srv.model_card() for srv in self.servers.values()]
        if self.route is not None:
            cards.append(self._route_card())
        return cards

    def model_card(self, model: str) -> P.ModelCard:
        return self._route_card() if self.is_routed(model) else self.server(model).model_card()

    def _route_card(self) -> P.ModelCard:
        lens = [self.servers[m].engine.max_model_len for m in self.route.router.models]
        return P.ModelCard(id=self.route.name, created=self.created, root=None, max_model_len=min(lens))

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
        if not self.is_routed(req.model):
            srv = self.server(req.model)
            req.check_supported()
            return await srv.completions(request, req, arrival)
        req.check_supported()
        text = _routing_text(req.prompt)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        cost_tokens = (sum(len(p.encode()) + 32 for p in prompts),
                       (req.max_tokens or self.route.max_model_len) * _width(req) * len(prompts))
        r = _RoutedRequest(request, text, req.max_tokens, cost_tokens, len(prompts), "cmpl")
        run = functools.partial(ModelServer.completions, request=request, arrival=arrival, routed=True)
        return await self._routed(r, req, run, cascade=len(prompts) == 1 and not req.echo)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        if self.draining:
            raise shutting_down()
        req = await parse_request(request, P.ChatCompletionRequest, self.stages)
        unknown = self.unknown_fields(req)
        return flag_unknown(await self.chat(request, req, arrival), unknown)

    async def chat(self, request: Request, req: P.ChatCompletionRequest, arrival: float) -> Response:
        """A parsed chat request, from /v1/chat/completions or translated from another API (Ollama, Anthropic,
        Responses): the key's cap, the checks, then its model's `chat_completions` (routed for the route name).
        Its answer is OpenAI's chat response or SSE stream."""
        if self.draining:
            raise shutting_down()
        self._admit(request, req, 1)
        if not self.is_routed(req.model):
            srv = self.server(req.model)
            req.check_supported()
            return self._reasoned(await srv.chat_completions(request, req, arrival))
        req.check_supported()
        users = [m.text() for m in req.messages if m.role == "user"]
        text = users[-1] if users else "\n".join(m.text() for m in req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        cost_tokens = (64 + sum(len(m.text().encode()) + 16 for m in req.messages),
                       (max_tokens or self.route.max_model_len) * _width(req))
        r = _RoutedRequest(request, text, max_tokens, cost_tokens, 1, "chatcmpl")
        run = functools.partial(ModelServer.chat_completions, request=request, arrival=arrival, routed=True)
        return self._reasoned(await self._routed(r, req, run, cascade=True))

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

    async def _routed(self, r: _RoutedRequest, req: P.CompletionRequest | P.ChatCompletionRequest,
                      run: Callable[..., Awaitable[Response]], cascade: bool) -> Response:
        """`run(srv, req=..., rid=...)` on the routed model (with fallback); in cascade mode, a request whose
        answer has one choice is answered by the weak model first (see `_cascade`)."""
        route = self.route
        decision = await self._decide(route.decide(r.text, r.max_tokens, r.key, r.cost_tokens))
        if (cascade and isinstance(route.router.policy, CascadePolicy) and req.n == 1 and not req.use_beam_search
                and not route.router.models[decision.model].strong):
            response, decision = await self._cascade(r, req, run, decision)
        else:
            response, decision = await self._run_on(r, decision, functools.partial(run, req=req))
        route.router.record_served(decision)
        self.metrics.router_requests.labels(decision.model, decision.category).inc()
        response.headers["x-pagedlm-routed-model"] = decision.model
        response.headers["x-pagedlm-route-reason"] = decision.category
        response.headers["x-pagedlm-route-detail"] = _header_text(decision.reason)
        return response

    async def _run_on(self, r: _RoutedRequest, decision: Decision,
                      run: Callable[..., Awaitable[Response]]) -> tuple[Response, Decision]:
        """`run` on `decision`'s model; on `Unavailable`, on the router's fallback, until one takes it. The
        request's budget hold is settled by the route when its engine requests end, or dropped if it never ran."""
        route, metrics = self.route, self.metrics
        tried: list[str] = []
        while True:
            rid = f"{r.id_prefix}-{uuid.uuid4().hex}"
            ids = request_ids(rid, r.num_prompts)
            route.track(decision, ids)
            try:
                response = await run(self.servers[decision.model], rid=rid)
            except Unavailable as e:
                route.untrack(decision, ids)
                logger.warning("Routed model %s is unavailable (%s); falling back", decision.model, e.message)
                tried.append(decision.model)
                try:
                    nxt = await self._decide(route.fallback(decision, r.text, r.max_tokens, tried, r.key,
                                                            r.cost_tokens))
                except Unavailable:
                    raise e from None
                metrics.router_fallbacks.labels(decision.model, nxt.model).inc()
                decision = nxt
                continue
            except APIError:
                route.untrack(decision, ids)  # refused before it ran (invalid for this model)
                raise
            route.router.report_success(decision.model)
            return response, decision

    async def _cascade(self, r: _RoutedRequest, req: P.CompletionRequest | P.ChatCompletionRequest,
                       run: Callable[..., Awaitable[Response]], decision: Decision) -> tuple[Response, Decision]:
        """The weak model answers in full (not streamed, with logprobs); the router judges the answer's mean
        token logprob. A confident answer goes back to the client (as a stream if it asked for one); otherwise
        the request is re-run on the strong model, as the client asked, and nothing of the weak answer is sent."""
        chat = isinstance(req, P.ChatCompletionRequest)
        samples = self.route.router.policy.samples
        inner = req.model_copy(update={"stream": False, "stream_options": None, "n": samples, **(
            {"logprobs": True, "top_logprobs": req.top_logprobs or 0} if chat else {"logprobs": req.logprobs or 0})})
        response, decision = await self._run_on(r, decision, functools.partial(run, req=inner))
        body, texts = _first_choice(json.loads(response.body), samples, chat)
        if self.route.router.models[decision.model].strong:  # a fallback took it to the strong tier
            return _kept_answer(body, req, chat), decision
        lps = _answer_logprobs(body["choices"][0], chat)
        answer = WeakAnswer.of(lps, texts)
        try:
            strong, why = await self._decide(self.route.escalate(decision, answer, r.text, r.max_tokens, r.key,
                                                                 r.cost_tokens))
        except APIError as e:  # no strong model can take it now (budget, down): the weak answer stands
            strong, why = None, f"cascade: weak answer kept, the strong model is unavailable ({e.message})"
        self.metrics.router_cascade.labels("escalated" if strong else "kept").inc()
        if strong is None:
            return _kept_answer(body, req, chat), replace(decision, reason=why, policy_strong=False)
        return await self._run_on(r, strong, functools.partial(run, req=req))

    async def _decide(self, decision: Awaitable[D]) -> D:
        t0 = time.perf_counter()
        try:
            return await decision
        except NoCandidateError as e:
            raise Unavailable(503, f"No model can take the request: {e}", type="server_error",
                               code="no_model_available", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except BudgetExceededError as e:
            self.metrics.router_budget_refusals.inc()
            raise APIError(429, f"Routing budget exhausted: {e}", type="insufficient_quota", code="budget_exceeded",
                           headers={"Retry-After": str(math.ceil(e.retry_after_s))}) from None
        finally:
            self.metrics.router_decision.observe(time.perf_counter() - t0)


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
        response.headers[UNKNOWN_FIELDS_HEADER] = _header_text(",".join(unknown), limit=1024)
    return response


def _num_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


def _routing_text(prompt: str | list[int] | list[str] | list[list[int]]) -> str:
    """The text a completion request is routed on; token ids cannot be routed (each model has its own)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    raise APIError(400, "Token-id prompts need a named model (token ids differ between models).", param="prompt")


@dataclass
class _RoutedRequest:
    """What routing needs of one request routed by `auto`."""

    request: Request
    text: str  # routed on
    max_tokens: int | None
    cost_tokens: tuple[int, int]  # bounds on its (prompt, completion) tokens, for budget holds
    num_prompts: int
    id_prefix: str

    @property
    def key(self) -> str | None:
        return getattr(self.request.state, "api_key", None)


def _answer_logprobs(choice: dict, chat: bool) -> list[float]:
    lp = choice.get("logprobs") or {}
    if chat:
        return [c["logprob"] for c in lp.get("content") or []]
    return [v for v in lp.get("token_logprobs") or [] if v is not None]


def _first_choice(body: dict, samples: int, chat: bool) -> tuple[dict, list[str]]:
    """The body with only its first choice (the answer kept; its usage counts that choice's tokens alone), and the
    text of every choice when the weak model drew `samples` > 1 of them (n=k)."""
    if samples <= 1:
        return body, []
    choices = sorted(body["choices"], key=lambda c: c["index"])
    texts = [(c["message"]["content"] or "") if chat else c["text"] for c in choices]
    first = choices[0]
    body["choices"] = [first]
    usage = body.get("usage")
    if usage:
        usage["completion_tokens"] = len(_answer_logprobs(first, chat))
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return body, texts


def _kept_answer(body: dict, req: P.CompletionRequest | P.ChatCompletionRequest, chat: bool) -> Response:
    """A cascade's complete answer, as the client asked for it: logprobs only if asked, streamed if asked."""
    asked = req.logprobs if chat else req.logprobs is not None
    if not asked:
        for c in body["choices"]:
            c["logprobs"] = None
    if not req.stream:
        return JSONResponse(body)
    return StreamingResponse(_replay(body, req, chat), media_type="text/event-stream")


async def _replay(body: dict, req: P.CompletionRequest | P.ChatCompletionRequest, chat: bool) -> AsyncIterator[str]:
    """A complete response as the events of a stream (one chunk of text, then finish and usage)."""
    usage = P.UsageInfo.model_validate(body["usage"])
    head = {"id": body["id"], "created": body["created"], "model": body["model"]}
    if chat:
        (c,) = body["choices"]
        lps = P.ChatLogprobs.model_validate(c["logprobs"]) if c["logprobs"] else None
        for choice in (P.ChatStreamChoice(index=0, delta=P.DeltaMessage(role="assistant", content="")),
                       P.ChatStreamChoice(index=0, delta=P.DeltaMessage(content=c["message"]["content"]),
                                          logprobs=lps),
                       P.ChatStreamChoice(index=0, delta=P.DeltaMessage(), finish_reason=c["finish_reason"],
                                          stop_reason=c["stop_reason"])):
            yield event(P.ChatCompletionChunk(**head, choices=[choice],
                                               usage=usage if req.continuous_usage and req.include_usage else None))
        if req.include_usage:
            yield event(P.ChatCompletionChunk(**head, choices=[], usage=usage))
    else:
        yield event(P.CompletionResponse(**head, choices=[P.CompletionChoice.model_validate(c)
                                                            for c in body["choices"]],
                                          usage=usage if req.continuous_usage and req.include_usage else None))
        if req.include_usage:
            yield event(P.CompletionResponse(**head, choices=[], usage=usage))
    yield DONE


def _width(req: P.SamplingRequest) -> int:
    return max(req.n, (req.beam_width or req.n) if req.use_beam_search else 1)




def _header_text(text: str, limit: int = 512) -> str:
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:limit]

