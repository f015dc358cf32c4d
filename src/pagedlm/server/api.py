"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncLLMEngine per served model.

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize,
/tokenizer_info, /version. Errors use OpenAI's JSON shape. A request whose client disconnects is aborted
at once (streaming or not), and every path out of a handler aborts what it queued.

A request names its model (none: the first served one). With an `AutoRoute`, the route's name (`auto`) lets
the router choose; a model that refuses (queue full), fails or is down before anything reached the client is
replaced by the router's fallback. The choice is in the `x-pagedlm-routed-model` / `x-pagedlm-route-reason`
headers and in the body's `model`; a routed request past every spend cap gets 429 (`budget_exceeded`).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pagedlm import __version__
from pagedlm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from pagedlm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedlm.router import BudgetExceededError, CascadePolicy, Decision, NoCandidateError
from pagedlm.sampling.detokenizer import held_back
from pagedlm.sampling.params import SamplingParams
from pagedlm.server import DEFAULT_MAX_PROMPTS_PER_REQUEST
from pagedlm.server import protocol as P
from pagedlm.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedlm.server.protocol import APIError
from pagedlm.server.routing import AutoRoute
from pagedlm.server.tools import TOOL_PARSERS, HermesToolParser

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
D = TypeVar("D")
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version"})
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
RETRY_AFTER_S = 1
UNKNOWN_FIELDS_HEADER = "x-pagedlm-unknown-fields"
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}  # union members in pydantic error paths


def build_app(engines: Mapping[str, AsyncLLMEngine], api_key: str | Sequence[str] | None = None,
              max_body_bytes: int = 8 * 2**20, route: AutoRoute | None = None, *,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST, allowed_origins: Sequence[str] = (),
              allowed_hosts: Sequence[str] | None = None, prefix_cache_per_key: bool = False,
              strict_request_fields: bool = False, tool_call_parser: str | None = None) -> FastAPI:
    """The app serving each engine under its name (the first is the default for requests without `model`).

    api_key: one key or several; if set, a bearer token everywhere except PUBLIC_PATHS.
    max_prompts_per_request: bound on prompts x n (or beam_width) of one request.
    allowed_origins: origins given CORS access (default none: browsers cannot read responses).
    allowed_hosts: if not None, Host headers other than loopback names and these are refused (DNS rebinding);
    "*" allows any.
    prefix_cache_per_key: salt the prefix cache with the API key, so tenants never share cached blocks.
    strict_request_fields: unknown request fields are a 400 (else they are named in UNKNOWN_FIELDS_HEADER).
    tool_call_parser: the format tool calls are parsed from (server.tools.TOOL_PARSERS; None: tools are refused).
    """
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"Unknown tool call parser {tool_call_parser!r}; known: {sorted(TOOL_PARSERS)}.")
    if not engines:
        raise ValueError("build_app needs at least one engine")
    if max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}.")
    keys = [api_key] if isinstance(api_key, str) else [k for k in api_key or () if k]
    app = FastAPI(title="pagedlm", version=__version__)
    metrics = ServerMetrics(engines, router=route.router if route is not None else None)
    servers = {name: _Server(engine, name, max_prompts_per_request, prefix_cache_per_key,
                             TOOL_PARSERS[tool_call_parser]() if tool_call_parser else None)
               for name, engine in engines.items()}
    front = _Frontend(servers, metrics, route, strict_request_fields)
    app.state.server = front
    hosts = None if allowed_hosts is None else frozenset(h.lower() for h in (*LOOPBACK_HOSTS, *allowed_hosts))
    app.add_middleware(_Guard, api_keys=keys, max_body_bytes=max_body_bytes, allowed_hosts=hosts)
    if allowed_origins:  # outermost: preflight requests carry no key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> Response:
        return _error_response(APIError(400, str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        return _error_response(APIError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        logger.exception("Unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"Internal server error ({type(e).__name__}); see the server log.",
                                        type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if front.draining:
            raise _shutting_down()
        dead = [name for name, srv in front.servers.items() if not srv.engine.is_running]
        if dead:
            raise APIError(503, f"The engine loop has stopped ({', '.join(dead)}).", type="server_error")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(P.ModelList(data=front.model_cards()))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        return _json(front.model_card(model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.chat_completions(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await _parse(request, P.TokenizeRequest)
        return await asyncio.to_thread(front.server(req.model).tokenize, req)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await _parse(request, P.DetokenizeRequest)
        return await asyncio.to_thread(front.server(req.model).detokenize, req)

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> Response:
        return JSONResponse(front.server(model).tokenizer_info())

    return app


class _Unavailable(APIError):
    """The chosen model could not take or finish the request (queue full, failed, stopped) before anything
    reached the client; a routed request tries another model."""


def _shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", type="server_error", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


# --- model resolution and routing -----------------------------------------------------------------------------
class _Frontend:
    """Resolves each request's model and, for the route name, routes it (with fallback)."""

    def __init__(self, servers: dict[str, _Server], metrics: ServerMetrics, route: AutoRoute | None,
                 strict_request_fields: bool = False) -> None:
        self.servers, self.metrics, self.route = servers, metrics, route
        self.strict_request_fields = strict_request_fields
        self.default = next(iter(servers.values()))
        self.created = int(time.time())
        self.draining = False  # set by a graceful shutdown: new generation requests get 503

    def begin_shutdown(self) -> None:
        self.draining = True

    def fail_open_requests(self, message: str) -> None:
        """End every open request with an error (streams get an error event and [DONE])."""
        for srv in self.servers.values():
            srv.engine.fail_all(message)

    @property
    def num_open_requests(self) -> int:
        return sum(srv.engine.num_open_requests for srv in self.servers.values())

    def server(self, model: str | None) -> _Server:
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
            raise _shutting_down()
        req = await _parse(request, P.CompletionRequest)
        unknown = self._unknown_fields(req)
        if not self.is_routed(req.model):
            srv = self.server(req.model)
            req.check_supported()
            return _flag_unknown(await srv.completions(request, req, arrival), unknown)
        req.check_supported()
        text = _routing_text(req.prompt)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        cost_tokens = (sum(len(p.encode()) + 32 for p in prompts),
                       (req.max_tokens or self.route.max_model_len) * _width(req) * len(prompts))
        r = _RoutedRequest(request, text, req.max_tokens, cost_tokens, len(prompts), "cmpl")
        run = functools.partial(_Server.completions, request=request, arrival=arrival, routed=True)
        return _flag_unknown(await self._routed(r, req, run, cascade=len(prompts) == 1 and not req.echo),
                             unknown)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        if self.draining:
            raise _shutting_down()
        req = await _parse(request, P.ChatCompletionRequest)
        unknown = self._unknown_fields(req)
        if not self.is_routed(req.model):
            srv = self.server(req.model)
            req.check_supported()
            return _flag_unknown(await srv.chat_completions(request, req, arrival), unknown)
        req.check_supported()
        users = [m.text() for m in req.messages if m.role == "user"]
        text = users[-1] if users else "\n".join(m.text() for m in req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        cost_tokens = (64 + sum(len(m.text().encode()) + 16 for m in req.messages),
                       (max_tokens or self.route.max_model_len) * _width(req))
        r = _RoutedRequest(request, text, max_tokens, cost_tokens, 1, "chatcmpl")
        run = functools.partial(_Server.chat_completions, request=request, arrival=arrival, routed=True)
        return _flag_unknown(await self._routed(r, req, run, cascade=True), unknown)

    def _unknown_fields(self, req: BaseModel) -> list[str]:
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
        decision = await self._decide(route.route(r.text, r.max_tokens, r.key, r.cost_tokens))
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
        """`run` on `decision`'s model; on `_Unavailable`, on the router's fallback, until one takes it. The
        request's budget hold is settled by the route when its engine requests end, or dropped if it never ran."""
        route, metrics = self.route, self.metrics
        tried: list[str] = []
        while True:
            rid = f"{r.id_prefix}-{uuid.uuid4().hex}"
            ids = _request_ids(rid, r.num_prompts)
            route.track(decision, ids)
            try:
                response = await run(self.servers[decision.model], rid=rid)
            except _Unavailable as e:
                route.untrack(decision, ids)
                logger.warning("Routed model %s is unavailable (%s); falling back", decision.model, e.message)
                tried.append(decision.model)
                try:
                    nxt = await self._decide(route.fallback(decision, r.text, r.max_tokens, tried, r.key,
                                                            r.cost_tokens))
                except _Unavailable:
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
        inner = req.model_copy(update={"stream": False, "stream_options": None, **(
            {"logprobs": True, "top_logprobs": req.top_logprobs or 0} if chat else {"logprobs": req.logprobs or 0})})
        response, decision = await self._run_on(r, decision, functools.partial(run, req=inner))
        if self.route.router.models[decision.model].strong:  # a fallback took it to the strong tier
            return _kept_answer(json.loads(response.body), req, chat), decision
        body = json.loads(response.body)
        lps = _answer_logprobs(body["choices"][0], chat)
        mean = sum(lps) / len(lps) if lps else 0.0
        try:
            strong, why = await self._decide(self.route.escalate(decision, mean, r.text, r.max_tokens, r.key,
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
            raise _Unavailable(503, f"No model can take the request: {e}", type="server_error",
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


def _flag_unknown(response: Response, unknown: list[str]) -> Response:
    if unknown:
        response.headers[UNKNOWN_FIELDS_HEADER] = _header_text(",".join(unknown), limit=1024)
    return response


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
            yield _event(P.ChatCompletionChunk(**head, choices=[choice],
                                               usage=usage if req.continuous_usage and req.include_usage else None))
        if req.include_usage:
            yield _event(P.ChatCompletionChunk(**head, choices=[], usage=usage))
    else:
        yield _event(P.CompletionResponse(**head, choices=[P.CompletionChoice.model_validate(c)
                                                            for c in body["choices"]],
                                          usage=usage if req.continuous_usage and req.include_usage else None))
        if req.include_usage:
            yield _event(P.CompletionResponse(**head, choices=[], usage=usage))
    yield "data: [DONE]\n\n"


def _width(req: P.SamplingRequest) -> int:
    return max(req.n, (req.beam_width or req.n) if req.use_beam_search else 1)


def _request_ids(rid: str, num_prompts: int) -> list[str]:
    """The engine request ids of a request `rid` with `num_prompts` prompts."""
    return [rid] if num_prompts == 1 else [f"{rid}-{i}" for i in range(num_prompts)]


def _header_text(text: str, limit: int = 512) -> str:
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:limit]


# --- the handlers ---------------------------------------------------------------------------------------------
@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None = None  # the text the client sent, if it sent text


@dataclass
class _ChoiceState:
    sent_chars: int = 0
    sent_tokens: int = 0
    text_offset: int = 0
    echoed: bool = False
    done: bool = False


class _Server:
    """One served model: its requests, after the model is resolved (tokenizer, template, limits are its own).
    `routed` requests also wait, when streaming, for the first outputs before the response starts, so that a
    failure then is still `_Unavailable`."""

    def __init__(self, engine: AsyncLLMEngine, name: str, max_prompts_per_request: int = 256,
                 prefix_cache_per_key: bool = False, tool_parser: HermesToolParser | None = None) -> None:
        self.engine, self.name = engine, name
        self.tool_parser = tool_parser
        self.tok = engine.tokenizer
        self.created = int(time.time())
        self.max_prompts_per_request = max_prompts_per_request
        self.prefix_cache_per_key = prefix_cache_per_key

    def _cache_salt(self, request: Request, req: P.SamplingRequest) -> str | None:
        """The client's `cache_salt`, prefixed (with --prefix-cache-per-key) by a hash of its API key."""
        key = getattr(request.state, "api_key", None) if self.prefix_cache_per_key else None
        if key is None:
            return req.cache_salt
        tenant = hashlib.sha256(key.encode()).hexdigest()[:32]
        return tenant if req.cache_salt is None else f"{tenant}:{req.cache_salt}"

    def _check_fan_out(self, num_prompts: int, req: P.SamplingRequest) -> None:
        width = (req.beam_width or req.n) if req.use_beam_search else req.n
        if num_prompts * width > self.max_prompts_per_request:
            raise APIError(400, f"The request asks for {num_prompts} prompts x {width} sequences; at most "
                                f"{self.max_prompts_per_request} are allowed per request (max_prompts_per_request).",
                           param="n" if num_prompts == 1 else "prompt")

    def model_card(self) -> P.ModelCard:
        return P.ModelCard(id=self.name, created=self.created, root=str(self.engine.engine.model_path),
                           max_model_len=self.engine.max_model_len)

    # --- completions ---
    async def completions(self, request: Request, req: P.CompletionRequest, arrival: float,
                          routed: bool = False, rid: str | None = None) -> Response:
        prompts = await self._completion_prompts(req)
        k = req.logprobs
        params = req.sampling_params(req.max_tokens, logprobs=k, prompt_logprobs=req.prompt_logprobs
                                     if req.prompt_logprobs is not None else k if req.echo else None)
        self._check_fits([len(p.token_ids) for p in prompts], params)
        await self._prepare(req, params)
        rid = rid or f"cmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, [p.token_ids for p in prompts], params, req.priority, arrival,
                                     self._cache_salt(request, req))
        if req.stream:
            if routed:
                await _first_outputs(request, streams)
            return _sse(self._completion_events(req, rid, prompts, streams, params), streams)
        finals = await _collect(request, streams)
        choices = [self._completion_choice(i * params.n + o.index, req, params, prompt, out, o, _ChoiceState())
                   for i, (prompt, out) in enumerate(zip(prompts, finals)) for o in out.outputs]
        if req.prompt_logprobs is not None:
            for c in choices:
                c.prompt_logprobs = _prompt_logprobs(finals[c.index // params.n])
        return _json(P.CompletionResponse(id=rid, model=self.name, choices=choices, usage=_usage(finals)))

    async def _completion_prompts(self, req: P.CompletionRequest) -> list[_Prompt]:
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "The prompt is empty.", param="prompt")
        if len(prompt) > self.engine.max_waiting:
            raise APIError(400, f"A request may hold at most {self.engine.max_waiting} prompts.", param="prompt")
        self._check_fan_out(len(prompt), req)
        out = await asyncio.to_thread(
            lambda: [_Prompt(self.tok.encode(p), p) if isinstance(p, str) else _Prompt(list(p)) for p in prompt])
        for p in out:
            self._check_prompt(p.token_ids)
        return out

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt")
        if len(ids) >= self.engine.max_model_len:
            raise APIError(400, f"The prompt has {len(ids)} tokens; this model's maximum context length is "
                                f"{self.engine.max_model_len} tokens, including at least one generated token.",
                           param="prompt", code="context_length_exceeded")

    def _check_fits(self, prompt_lens: list[int], params: SamplingParams) -> None:
        """Refuse requests the engine could never finish even alone: more samples than max_num_seqs, or n
        sequences of their longest length that do not fit in the KV cache together (endless preemption)."""
        cfg, max_len = self.engine.engine.config, self.engine.max_model_len
        if params.n > cfg.max_num_seqs:
            raise APIError(400, f"n={params.n} exceeds this server's max_num_seqs ({cfg.max_num_seqs}).", param="n")
        blocks = self.engine.engine.block_manager.num_total_blocks  # one replica's, with several
        for p in prompt_lens:
            length = min(p + max(1, max_len if params.max_tokens is None else params.max_tokens), max_len)
            if params.n * self.engine.engine.block_manager.max_blocks_needed(
                    length, length, 1, cfg.max_num_batched_tokens) > blocks:
                bm = self.engine.engine.block_manager
                raise APIError(400, f"{params.n} sequences of up to {length} tokens do not fit in the KV cache "
                                    f"({blocks} blocks; one sequence fits at most "
                                    f"{bm.max_tokens_per_seq(cfg.max_num_batched_tokens)} tokens); "
                                    "lower n or max_tokens.", param="n")

    def _echo_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tok.decode(prompt.token_ids, skip_special_tokens=False)

    def _completion_choice(self, index: int, req: P.CompletionRequest, params: SamplingParams, prompt: _Prompt,
                           out: RequestOutput, o: CompletionOutput, state: _ChoiceState) -> P.CompletionChoice:
        """The choice for what `state` has not sent yet of `o` (all of it, echo included, for a fresh state)."""
        text, t0, t1 = _advance(state, o, params.stop)
        echo, state.echoed = req.echo and not state.echoed, True
        logprobs = None
        if req.logprobs is not None:
            logprobs = P.CompletionLogprobs()
            if echo:
                entries = out.prompt_logprobs or [None] * len(prompt.token_ids)
                state.text_offset = self._add_completion_logprobs(logprobs, prompt.token_ids, entries,
                                                                  state.text_offset)
            state.text_offset = self._add_completion_logprobs(logprobs, o.token_ids[t0:t1],
                                                              (o.logprobs or [])[t0:t1], state.text_offset)
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
        states = [_ChoiceState() for _ in range(len(prompts) * n)]
        latest: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, out in _merge(streams):
                latest[i] = out
                for o in out.outputs:
                    st = states[i * n + o.index]
                    if st.done:
                        continue
                    choice = self._completion_choice(i * n + o.index, req, params, prompts[i], out, o, st)
                    if choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs.tokens):
                        usage = _usage(latest) if req.continuous_usage and req.include_usage else None
                        yield _event(P.CompletionResponse(id=rid, created=created, model=self.name,
                                                          choices=[choice], usage=usage))
            if req.include_usage:
                yield _event(P.CompletionResponse(id=rid, created=created, model=self.name, choices=[],
                                                  usage=_usage(latest)))
            yield "data: [DONE]\n\n"
        except (RequestFailedError, EngineDeadError) as e:
            yield _event_error(APIError(500, str(e), type="server_error"))
            yield "data: [DONE]\n\n"
        finally:
            _abort_all(streams)

    # --- chat ---
    async def chat_completions(self, request: Request, req: P.ChatCompletionRequest, arrival: float,
                               routed: bool = False, rid: str | None = None) -> Response:
        self._check_fan_out(1, req)
        if req.tools_active and self.tool_parser is None:
            raise APIError(400, "This server does not parse tool calls (start it with --tool-call-parser).",
                           param="tools")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools_active else None
        ids = await asyncio.to_thread(self._chat_prompt, req.messages, req.add_generation_prompt, tools)
        self._check_prompt(ids)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, logprobs=k,
                                     prompt_logprobs=req.prompt_logprobs)
        functions = req.called_functions()
        if functions is not None:  # tool_choice "required" or a named function: the decoder enforces the calls
            params.structured_outputs = self.tool_parser.call_grammar(
                functions, parallel=req.parallel_tool_calls and not isinstance(req.tool_choice, P.NamedToolChoice))
        self._check_fits([len(ids)], params)
        await self._prepare(req, params)
        rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._submit(rid, [ids], params, req.priority, arrival, self._cache_salt(request, req))
        if req.stream:
            if routed:
                await _first_outputs(request, streams)
            return _sse(self._chat_events(req, rid, streams, params), streams)
        (out,) = await _collect(request, streams)
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
        return _json(P.ChatCompletionResponse(
            id=rid, model=self.name, choices=choices, usage=_usage([out]),
            prompt_logprobs=_prompt_logprobs(out) if req.prompt_logprobs is not None else None))

    def _chat_prompt(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                     tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids. Assistant tool calls and tool results are rendered: by the template where it
        knows them (its `tool_calls`), else as Hermes-style text in the turn's content."""
        knows_calls = "tool_calls" in (self.tok.hf.chat_template or "")
        msgs = []
        for m in messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                calls = [{"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": _json_arguments(c.function.arguments)}}
                         for c in m.tool_calls]
                if knows_calls:
                    msg["tool_calls"] = calls
                else:
                    msg["content"] += "".join(
                        f'\n<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                        f'{json.dumps(c["function"]["arguments"])}}}\n</tool_call>' for c in calls)
            msgs.append(msg)
        try:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools)
        except Exception as e:  # noqa: BLE001 - no template, or the template rejected the messages
            raise APIError(400, f"Cannot apply the chat template: {e}", param="messages") from None
        return self.tok.encode(text, add_special_tokens=False)

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
                           params: SamplingParams) -> AsyncIterator[str]:
        created, n = int(time.time()), params.n
        k = (req.top_logprobs or 0) if req.logprobs else None
        stops = params.stop
        states = [_ChoiceState() for _ in range(n)]
        latest: list[RequestOutput | None] = [None]

        def chunk(index: int, delta: P.DeltaMessage, **kw: Any) -> str:
            usage = _usage(latest) if req.continuous_usage and req.include_usage else None
            return _event(P.ChatCompletionChunk(id=rid, created=created, model=self.name, usage=usage,
                                                choices=[P.ChatStreamChoice(index=index, delta=delta, **kw)]))

        try:
            for j in range(n):
                yield chunk(j, P.DeltaMessage(role="assistant", content=""))
            async for _, out in _merge(streams):
                latest[0] = out
                for o in out.outputs:
                    st = states[o.index]
                    if st.done:
                        continue
                    if req.tools_active:
                        for event in self._tool_events(st, o, stops, chunk):
                            yield event
                        continue
                    text, t0, t1 = _advance(st, o, stops)
                    lps = None
                    if k is not None and t1 > t0:
                        lps = self._chat_logprobs(o.token_ids[t0:t1], (o.logprobs or [])[t0:t1], k)
                    if text or lps:
                        yield chunk(o.index, P.DeltaMessage(content=text), logprobs=lps)
                    if st.done:
                        yield chunk(o.index, P.DeltaMessage(), finish_reason=o.finish_reason,
                                    stop_reason=o.stop_reason)
            if req.include_usage:
                yield _event(P.ChatCompletionChunk(id=rid, created=created, model=self.name, choices=[],
                                                   usage=_usage(latest)))
            yield "data: [DONE]\n\n"
        except (RequestFailedError, EngineDeadError) as e:
            yield _event_error(APIError(500, str(e), type="server_error"))
            yield "data: [DONE]\n\n"
        finally:
            _abort_all(streams)

    def _tool_events(self, st: _ChoiceState, o: CompletionOutput, stops: list[str],
                     chunk: Callable[..., str]) -> list[str]:
        """Stream events of one choice when tools are offered: content up to the first tool call as it comes
        (a possible start of `<tool_call>` held back), then, once the output is complete, its calls in one
        `delta.tool_calls` and finish_reason "tool_calls"."""
        parser, text = self.tool_parser, o.text
        st.done = o.finish_reason is not None
        cut = text.find(parser.start)
        events = []
        if not st.done:
            end = cut if cut != -1 else len(text) - held_back(text, [parser.start, *stops])
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
        """Token controls checked against the vocabulary and the constraint compiled (cached) on a worker
        thread, so that the engine thread finds it compiled; 400 naming the problem."""
        try:
            await asyncio.to_thread(self.engine.engine.prepare_params, params)
        except ValueError as e:
            fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "logit_bias", "allowed_token_ids", "bad_words", "tools")
            param = next((f for f in fields if str(e).startswith(f)), None) \
                or next((f for f in fields if getattr(req, f, None) is not None), None)
            raise APIError(400, str(e), param=param) from None

    # --- submission ---
    async def _submit(self, rid: str, prompts: list[list[int]], params: SamplingParams, priority: int,
                      arrival: float, cache_salt: str | None = None) -> list[RequestStream]:
        """Queue every prompt or none: on any refusal the accepted ones are aborted and the error raised."""
        ids = _request_ids(rid, len(prompts))
        streams = [self.engine.submit(i, p, params, priority, arrival, cache_salt) for i, p in zip(ids, prompts)]
        try:
            results = await asyncio.gather(*(s.accepted() for s in streams), return_exceptions=True)
        except BaseException:
            _abort_all(streams)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return streams
        _abort_all(streams)
        e = errors[0]
        if isinstance(e, QueueFullError):
            raise _Unavailable(503, str(e), type="server_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        if isinstance(e, EngineDeadError):
            raise _Unavailable(503, str(e), type="server_error")
        if isinstance(e, ValueError):
            raise APIError(400, str(e))
        raise e

    # --- tokenizer endpoints ---
    def tokenize(self, req: P.TokenizeRequest) -> Response:
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of `prompt` or `messages`.")
        if req.messages is not None:
            P.check_contents(req.messages)
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = self.tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
            except Exception as e:  # noqa: BLE001
                raise APIError(400, f"Cannot apply the chat template: {e}", param="messages") from None
            add_special = bool(req.add_special_tokens)
        else:
            text, add_special = req.prompt, req.add_special_tokens is not False
        ids = self.tok.encode(text, add_special_tokens=add_special)
        strs = [t or "" for t in self.tok.hf.convert_ids_to_tokens(ids)] if req.return_token_strs else None
        return _json(P.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                        token_strs=strs))

    def detokenize(self, req: P.DetokenizeRequest) -> Response:
        vocab = len(self.tok.hf)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens")
        return _json(P.DetokenizeResponse(prompt=self.tok.decode(req.tokens, skip_special_tokens=False)))

    def tokenizer_info(self) -> dict:
        """vLLM's shape: the tokenizer's JSON-able init kwargs plus its class, special tokens and template."""
        hf = self.tok.hf
        info = {}
        for key, value in hf.init_kwargs.items():
            value = getattr(value, "content", value)  # AddedToken -> str
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            info[key] = value
        info.update(tokenizer_class=type(hf).__name__, eos_token=hf.eos_token, bos_token=hf.bos_token,
                    pad_token=hf.pad_token, unk_token=hf.unk_token, chat_template=hf.chat_template,
                    model_max_length=self.engine.max_model_len, vocab_size=len(hf),
                    eos_token_ids=sorted(self.engine.engine.eos_token_ids))
        return info


# --- helpers --------------------------------------------------------------------------------------------------
def _advance(st: _ChoiceState, o: CompletionOutput, stops: list[str]) -> tuple[str, int, int]:
    """Text and token range of `o` not yet sent. Unfinished text that could still grow into a stop string is
    held back, so nothing sent is later cut; returns (text delta, first new token, end of new tokens)."""
    st.done = o.finish_reason is not None
    end = len(o.text) if st.done else max(len(o.text) - held_back(o.text, stops), st.sent_chars)
    text = o.text[st.sent_chars:end]
    t0, t1 = st.sent_tokens, len(o.token_ids)
    st.sent_chars, st.sent_tokens = end, t1
    return text, t0, t1


def _json_arguments(arguments: str | dict) -> dict | str:
    """A tool call's arguments as an object (templates write it with tojson), or the text if it is not JSON."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _prompt_logprobs(out: RequestOutput) -> list[dict[str, P.PromptLogprob] | None]:
    return [None if entry is None else {str(t): P.PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank,
                                                                decoded_token=lp.decoded_token)
                                        for t, lp in entry.items()}
            for entry in out.prompt_logprobs or []]


def _token_str(srv: _Server, tid: int, entry: PositionLogprobs) -> str:
    lp = entry.get(tid)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return srv.tok.decode([tid], skip_special_tokens=False)


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0) if logprob == logprob else -9999.0


def _usage(outputs: list[RequestOutput | None]) -> P.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs if o is not None)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _parse(request: Request, model: type[T]) -> T:
    body = await request.body()
    try:
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ())]
        if err["type"] == "json_invalid":
            raise APIError(400, f"The request body is not valid JSON: {err['msg']}") from None
        where = ".".join(x for x in loc if x not in _TYPE_TAGS and "[" not in x) or "body"
        raise APIError(400, f"Invalid value for `{where}`: {err['msg']}", param=loc[0] if loc else None) from None


def _abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Newest outputs of all streams as (stream index, output), in arrival order; ends when all finished."""
    if len(streams) == 1:
        while not streams[0].finished:
            try:
                yield 0, await streams[0].next_latest()
            except StopAsyncIteration:
                return
        return
    pending = {asyncio.ensure_future(s.next_latest()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            ready, error = [], None
            for task in done:
                i = pending.pop(task)
                if task.exception() is None:
                    ready.append((i, task.result()))
                elif not isinstance(task.exception(), StopAsyncIteration):
                    error = error or task.exception()
            if error is not None:
                raise error
            for i, out in ready:
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].next_latest())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


async def _collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final outputs; aborts everything if the client disconnects first."""
    finals: list[RequestOutput] = [None] * len(streams)  # type: ignore[list-item]
    for s in streams:
        s.buffered = True  # nothing reaches the client before the end: a lost replica's request may be retried

    async def run() -> None:
        async for i, out in _merge(streams):
            finals[i] = out

    try:
        await _unless_disconnected(request, run())
    finally:
        _abort_all(streams)
    return finals


async def _first_outputs(request: Request, streams: list[RequestStream]) -> None:
    """Wait until every stream has an output ready (not consumed); on failure or disconnect, abort them all."""
    try:
        await _unless_disconnected(request, asyncio.gather(*(s.wait_output() for s in streams)))
    except BaseException:
        _abort_all(streams)
        raise


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> None:
    """Await `work`; 499 if the client disconnects first, `_Unavailable` (500) if the engine fails it."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "The client disconnected.")
    try:
        task.result()
    except (RequestFailedError, EngineDeadError) as e:
        raise _Unavailable(500, str(e), type="server_error") from None


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _event_error(e: APIError) -> str:
    return f"data: {json.dumps(e.body())}\n\n"


def _sse(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    return _EventStream(events, streams)


class _EventStream(StreamingResponse):
    """An SSE response that ends (closing the connection) once an output of its streams has waited unread
    longer than the engine's stall timeout: a client that stopped reading then holds nothing."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                         background=BackgroundTask(_abort_all, streams))
        self.streams = streams
        self.timeout = streams[0]._owner.stall_timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.timeout <= 0:
            return await super().__call__(scope, receive, send)

        def stalled() -> bool:
            now = time.monotonic()
            return any(s.unread_since is not None and now - s.unread_since > self.timeout for s in self.streams)

        async def receive_or_stall() -> dict:  # Starlette ends the response when this says "disconnect"
            msg = asyncio.ensure_future(receive())
            while not msg.done():
                await asyncio.wait({msg}, timeout=min(self.timeout, 1.0))
                if not msg.done() and stalled():
                    msg.cancel()
                    logger.warning("Closing a stream whose client stopped reading (%s)", self.streams[0].request_id)
                    _abort_all(self.streams)
                    return {"type": "http.disconnect"}
            return msg.result()

        await super().__call__(scope, receive_or_stall, send)


def _error_response(e: APIError) -> Response:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Guard:
    """ASGI middleware, before any parsing: Host header (400, DNS rebinding), bearer token (401), JSON
    Content-Type (415: no "simple" cross-site form posts) and request-body size (413)."""

    def __init__(self, app: Any, api_keys: list[str], max_body_bytes: int,
                 allowed_hosts: frozenset[str] | None = None) -> None:
        self.app, self.api_keys, self.max_body_bytes = app, api_keys, max_body_bytes
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.allowed_hosts is not None and not _host_allowed(headers.get("host", ""), self.allowed_hosts):
            return await _error_response(APIError(400, "Invalid Host header (see --allowed-hosts).",
                                                  code="invalid_host"))(scope, receive, send)
        if self.api_keys and scope["path"] not in PUBLIC_PATHS:
            key = self._key(headers.get("authorization", ""))
            if key is None:
                return await _error_response(APIError(401, "Invalid or missing API key (send `Authorization: "
                                                           "Bearer <key>`).", code="invalid_api_key",
                                                      headers={"WWW-Authenticate": "Bearer"}))(scope, receive, send)
            scope.setdefault("state", {})["api_key"] = key
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return await _error_response(APIError(415, "The request body must be JSON (Content-Type: "
                                                           "application/json).", code="unsupported_media_type"))(
                    scope, receive, send)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await _error_response(APIError(400, "Invalid Content-Length."))(scope, receive, send)
            if int(length) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        seen, rejected = 0, False

        async def limited_receive() -> dict:
            nonlocal seen, rejected
            msg = await receive()
            if msg["type"] == "http.request" and not rejected:
                seen += len(msg.get("body", b""))
                if seen > self.max_body_bytes:
                    rejected = True
                    await self._too_large(scope, receive, send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: dict) -> None:
            if not rejected:
                await send(msg)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not rejected:
                raise

    def _key(self, authorization: str) -> str | None:
        """The configured key the header carries (scheme `Bearer`, any case), else None."""
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip().encode()
        found = None
        for key in self.api_keys:  # compare with every key: the time taken does not tell which matched
            if hmac.compare_digest(token, key.encode()):
                found = key
        return found if scheme.lower() == "bearer" else None

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        await _error_response(APIError(413, f"The request body exceeds {self.max_body_bytes} bytes.",
                                       code="request_too_large"))(scope, receive, send)


def _host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """`host` (a Host header: name, IPv4 or [IPv6], with an optional port) is in `allowed` or is a loopback
    address; "*" in `allowed` admits any."""
    if "*" in allowed:
        return True
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if not host:
        return False
    if host in allowed:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback  # 127.0.0.0/8, ::1: loopback names are always allowed
    except ValueError:
        return False
