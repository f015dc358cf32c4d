"""The OpenAI-compatible HTTP API (FastAPI) over one engine (`EngineClient`) per served model.

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize,
/tokenizer_info, /version, and with `ui` the memory views (/debug/state, /ui: ui.py). Errors use OpenAI's JSON
shape. A request whose client disconnects is aborted at once (streaming or not), and every path out of a handler
aborts what it queued.

A request names its model (none: the first served one). With a `Dispatcher`, its name (`auto`, the auto model) lets
the router choose; a model that refuses (queue full), fails or is down before anything reached the client is
replaced by the router's fallback. The choice is in the `x-pagedlm-routed-model` / `x-pagedlm-route-reason`
headers and in the body's `model`; a routed request past every spend cap gets 429 (`budget_exceeded`).

This file wires the app: routes, exception handlers (every error in OpenAI's shape) and middleware. The rest:
frontend.py (parsing, admission, model resolution), auto.py (the auto model: the router's choice, fallback,
cascade), dispatch.py (the router's decisions and the engines' live load), endpoints/ (one model's endpoints, their
typed results, rendered as JSON or SSE), streaming.py (engine streams as the endpoints read them), middleware.py
(Host, key, Content-Type, body size checks), wire.py (request bodies in, JSON out), errors.py (engine errors as
OpenAI errors), openapi.py (/openapi.json with the bodies the routes parse). Engines are seen only through their
`EngineClient` contract (engine/client.py).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pagedlm import __version__
from pagedlm.engine.client import EngineClient
from pagedlm.engine.embedding_engine import EmbeddingEngine
from pagedlm.engine.protocol import POOLING_TYPES
from pagedlm.server import (
    DEFAULT_HEALTH_STEP_TIMEOUT,
    DEFAULT_LOGPROB_BUDGET,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUESTS_PER_KEY,
    DEFAULT_RESPONSES_STORE_SIZE,
    DEFAULT_RESPONSES_STORE_TTL,
    DEFAULT_STAGE_QUEUE,
    DEFAULT_STAGE_THREADS,
)
from pagedlm.server import protocol as P
from pagedlm.server.anthropic import add_anthropic_routes
from pagedlm.server.bridge import Bridge
from pagedlm.server.dispatch import Dispatcher
from pagedlm.server.embeddings import add_embedding_routes
from pagedlm.server.endpoints import ServedModel
from pagedlm.server.frontend import UNKNOWN_FIELDS_HEADER, Frontend
from pagedlm.server.limits import KeyLeases, LogprobBudget, RequestLimits
from pagedlm.server.llamacpp import add_llamacpp_routes
from pagedlm.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedlm.server.middleware import LOOPBACK_HOSTS, Guard
from pagedlm.server.ollama import add_ollama_routes
from pagedlm.server.openapi import Served, document_bodies
from pagedlm.server.protocol import APIError, shutting_down
from pagedlm.server.reasoning import REASONING_PARSERS
from pagedlm.server.response_store import ResponseStore
from pagedlm.server.responses import add_responses_routes
from pagedlm.server.stages import StagePools
from pagedlm.server.tools import TOOL_PARSERS, tool_support
from pagedlm.server.ui import MemoryState, add_ui_routes
from pagedlm.server.wire import error_response, json_response, parse_request

logger = logging.getLogger(__name__)

__all__ = ["UNKNOWN_FIELDS_HEADER", "build_app"]


def build_app(engines: Mapping[str, EngineClient], api_key: str | Sequence[str] | None = None,
              max_body_bytes: int = 8 * 2**20, dispatcher: Dispatcher | None = None, *,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST, allowed_origins: Sequence[str] = (),
              allowed_hosts: Sequence[str] | None = None, prefix_cache_per_key: bool = False,
              strict_request_fields: bool = False, tool_call_parser: str | None = None, auto_tool_choice: bool = True,
              health_step_timeout: float = DEFAULT_HEALTH_STEP_TIMEOUT,
              max_requests_per_key: int = DEFAULT_MAX_REQUESTS_PER_KEY, allow_client_priority: bool = False,
              limits: RequestLimits = RequestLimits(), stage_threads: int = DEFAULT_STAGE_THREADS,
              stage_queue: int = DEFAULT_STAGE_QUEUE, responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE,
              responses_store_ttl: float = DEFAULT_RESPONSES_STORE_TTL,
              embedders: Mapping[str, EmbeddingEngine] | None = None,
              reasoning_parser: str | None = None, thinking_token_budget: int | None = None, ui: bool = False,
              ui_show_text: bool = False, embedding_pooling: str = "last",
              logprob_budget: int = DEFAULT_LOGPROB_BUDGET) -> FastAPI:
    """The app serving each engine under its name (the first is the default for requests without `model`).

    api_key: one key or several; if set, a bearer token everywhere except PUBLIC_PATHS.
    dispatcher: serves the auto model (its router's models must be among `engines`); None: no auto model.
    max_prompts_per_request: bound on prompts x n (or beam_width) of one request.
    allowed_origins: origins given CORS access (default none: browsers cannot read responses).
    allowed_hosts: if not None, Host headers other than loopback names and these are refused (DNS rebinding);
    "*" allows any.
    prefix_cache_per_key: salt the prefix cache with the API key, so tenants never share cached blocks.
    strict_request_fields: unknown request fields are a 400 (else they are named in UNKNOWN_FIELDS_HEADER).
    tool_call_parser: the format tool calls are parsed from (server.tools.TOOL_PARSERS; None: the one matching each
    model's chat template, see tools.tool_support). auto_tool_choice: the model may choose to call tools
    (tool_choice "auto"); if False, only forced calls are served (a 400 otherwise, as vLLM without the flag).
    health_step_timeout: /health is 503 while an engine step has run longer than this, requests waiting (0: off).
    max_requests_per_key: engine requests (prompts) one API key may have open (waiting or running); beyond, 429
    (0: no cap; without keys there is none).
    allow_client_priority: requests may set `priority`; otherwise a non-zero one is a 400.
    limits: the other per-request bounds (chat messages, prompt characters, ...).
    stage_threads, stage_queue: each pre-engine stage's threads and the jobs that may wait for them (stages.py).
    responses_store_size, responses_store_ttl: the Responses API's stored responses per key, and for how long.
    embedders: the embedding models, by name (/v1/embeddings, /api/embed; names distinct from `engines`').
    embedding_pooling: how the generation models' embeddings pool their final hidden states (engine.protocol
    POOLING_TYPES: last, mean).
    reasoning_parser: split `<think>` reasoning out of chat answers (reasoning.REASONING_PARSERS; None: not).
    thinking_token_budget: chat requests without a `thinking_token_budget` of their own get this one (needs
    reasoning_parser; None: no budget).
    ui: serve the memory views (GET /debug/state, the web view at /ui; ui.py); ui_show_text: they show text.
    logprob_budget: logprob entries all admitted requests may keep on the host at once (limits.LogprobBudget; 0:
    no budget).
    """
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if not all(isinstance(k, str) and k.strip() for k in keys):
        raise ValueError("An API key is empty: give non-empty keys (or none to serve without one).")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning parser {reasoning_parser!r}; known: {sorted(REASONING_PARSERS)}.")
    if thinking_token_budget is not None and (thinking_token_budget < 0 or reasoning_parser is None):
        raise ValueError("thinking_token_budget must be >= 0 and needs a reasoning parser.")
    if embedding_pooling not in POOLING_TYPES:
        raise ValueError(f"Unknown embedding pooling {embedding_pooling!r}; known: {', '.join(POOLING_TYPES)}.")
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"Unknown tool call parser {tool_call_parser!r}; known: {sorted(TOOL_PARSERS)}.")
    if not engines:
        raise ValueError("build_app needs at least one engine")
    embedders = dict(embedders or {})
    if set(embedders) & set(engines):
        raise ValueError(f"Embedding and generation models share names: {sorted(set(embedders) & set(engines))}")
    if max_prompts_per_request < 1:
        raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}.")
    stages, budget = StagePools(stage_threads, stage_queue), LogprobBudget(logprob_budget)
    app = FastAPI(title="pagedlm", version=__version__, on_shutdown=[stages.shutdown])
    metrics = ServerMetrics(engines, router=dispatcher.router if dispatcher is not None else None,
                             stages=stages, logprob_budget=budget)
    models = {}
    for name, engine in engines.items():
        tools = tool_support(engine.input_processor.tokenizer.hf.chat_template, tool_call_parser)
        logger.info("%s: %s", name, tools.summary)
        models[name] = model = ServedModel(engine, name, max_prompts_per_request, prefix_cache_per_key, tools.parser,
                                           limits, stages, budget)
        model.tool_template, model.embedding_pooling = tools.template, embedding_pooling
        model.auto_tool_choice = auto_tool_choice
    front = Frontend(models, metrics, dispatcher, strict_request_fields, allow_client_priority)
    app.state.frontend = front
    front.reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
    front.thinking_token_budget = thinking_token_budget
    hosts = None if allowed_hosts is None else frozenset(h.lower() for h in (*LOOPBACK_HOSTS, *allowed_hosts))
    app.add_middleware(Guard, api_keys=keys, max_body_bytes=max_body_bytes, allowed_hosts=hosts,
                       leases=KeyLeases(max_requests_per_key) if max_requests_per_key else None)
    if allowed_origins:  # outermost: preflight requests carry no key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return error_response(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        return error_response(APIError(400, str(e)), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(APIError(e.status_code, str(e.detail), headers=e.headers), request.url.path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        logger.exception("Unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"Internal server error ({type(e).__name__}); see the server log.",
                                        type="server_error"), request.url.path)

    async def root() -> Response:  # Ollama's clients check that a server is up here (`ollama run`: HEAD /)
        return PlainTextResponse("pagedlm is running")

    app.get("/")(root)
    app.head("/")(root)

    @app.get("/health")
    async def health() -> Response:
        if front.draining:
            raise shutting_down()
        down = [f"{name}: {why}" for name, m in front.models.items() if (why := m.engine.down_reason)]
        if down:
            raise APIError(503, f"Not serving ({'; '.join(down)}).", type="server_error")
        stuck = [n for n, m in front.models.items() if 0 < health_step_timeout < m.engine.step_stuck_for]
        if stuck:
            raise APIError(503, f"An engine step has run longer than {health_step_timeout:g} s with requests "
                                f"waiting ({', '.join(stuck)}).", type="server_error")
        return JSONResponse({"status": "ok"})  # llama-server's body; vLLM's clients read the status alone

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(P.ModelList(data=front.model_cards() + embeddings.cards()))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        card = next((c for c in embeddings.cards() if c.id == model), None)
        return json_response(card or front.model_card(model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.chat_completions(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse_request(request, P.TokenizeRequest, stages)
        model = front.model(req.model)
        return json_response(await stages.run("tokenize" if req.messages is None else "chat", model.tokenize, req))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_request(request, P.DetokenizeRequest, stages)
        return json_response(await stages.run("tokenize", front.model(req.model).detokenize, req))

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> Response:
        return JSONResponse(front.model(model).tokenizer_info())

    if ui:
        add_ui_routes(app, MemoryState(engines, dispatcher.router if dispatcher is not None else None, ui_show_text))
    bridge = Bridge(front)
    add_ollama_routes(app, bridge)
    add_anthropic_routes(app, bridge)
    add_llamacpp_routes(app, bridge)
    add_responses_routes(app, bridge, ResponseStore(responses_store_size, responses_store_ttl))
    embeddings = add_embedding_routes(app, bridge, embedders)
    document_bodies(app, Served(
        list(engines), dispatcher.name if dispatcher is not None else None, list(embedders),
        max(e.max_model_len for e in engines.values()), min(e.input_processor.vocab_size for e in engines.values()),
        min((e.vocab_size for e in embedders.values()), default=None), allow_client_priority))
    return app

