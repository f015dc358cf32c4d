"""`pagedlm serve`'s own options (`ServerConfig`: one `option` field per flag, which cli.py adds to the parser) and
`ServeConfig`, all its settings typed: the engine's (EngineConfig), the server's, the engine loops' (LoopConfig),
the router's (RouterConfig) and the replicas' (ParallelConfig)."""
from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from pagedlm.config import (
    DEFAULT_MODEL,
    EngineConfig,
    LoopConfig,
    ParallelConfig,
    RouterConfig,
    check_choices,
    from_args,
    option,
    parse_bytes,
)
from pagedlm.config.loop import LIMITS
from pagedlm.config.router import ROUTING
from pagedlm.engine.protocol import POOLING_TYPES
from pagedlm.server import (
    DEFAULT_HEALTH_STEP_TIMEOUT,
    DEFAULT_LOGPROB_BUDGET,
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUESTS_PER_KEY,
    DEFAULT_REQUEST_READ_TIMEOUT,
    DEFAULT_RESPONSES_STORE_SIZE,
    DEFAULT_RESPONSES_STORE_TTL,
    DEFAULT_STAGE_QUEUE,
    DEFAULT_STAGE_THREADS,
)
from pagedlm.server.reasoning import REASONING_PARSERS
from pagedlm.server.tools import TOOL_PARSERS

API_KEY_ENV = "PAGEDLM_API_KEY"


def _size(value: str) -> int:
    """Bytes: a plain integer, or a size such as 8MiB."""
    return int(value) if value.strip().isdigit() else parse_bytes(value)


TOOLS = "tool calling"
UI = "memory views (see docs/memory-view.md)"


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServerConfig:
    """The server's own options, each a `pagedlm serve` flag of the same name."""

    host: str = option("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = option(8000, "port (0: any free port; the URL is logged)")
    ollama_port: int | None = option(None, "also serve the same app on this port, for clients that assume "
                                     "Ollama's (11434); every API answers on both (0: any free port)")
    api_key: list[str] | None = option(None, "require `Authorization: Bearer <key>` (repeatable: one key per tenant; "
                                       f"or set ${API_KEY_ENV}, comma-separated)")
    served_model_name: str | None = option(None, "model name clients use (default: --model; one model)")
    embedding_model: list[str] | None = option(None, "also serve this embedding model for /v1/embeddings and "
                                               "/api/embed (repeatable; NAME=MODEL names it; all-minilm-l6-v2 or a "
                                               "sentence-transformers BERT directory)", metavar="[NAME=]MODEL")
    embedding_pooling: str = option("last", "how a generation model's embeddings (/v1/embeddings, /api/embed) pool "
                                    "its final hidden states: the last token's (vLLM's default for decoders) or the "
                                    "mean of all tokens' (llama.cpp's --pooling mean); L2-normalized",
                                    choices=POOLING_TYPES)
    max_body_bytes: int = option(8 * 2**20, "largest request body, e.g. 8MiB (larger: 413)", parse=_size)
    disable_access_log: bool = option(False, "do not log each request")
    max_connections: int = option(DEFAULT_MAX_CONNECTIONS, "open HTTP connections served; a request on a connection "
                                  "beyond them gets 503 and the connection is closed (0: no limit)", group=LIMITS)
    request_read_timeout: float = option(DEFAULT_REQUEST_READ_TIMEOUT, "seconds a request's line, headers and body "
                                         "may take to arrive (from its first byte, or from the connection); then "
                                         "408 and the connection is closed (0: never)", group=LIMITS)
    max_prompts_per_request: int = option(DEFAULT_MAX_PROMPTS_PER_REQUEST, "most prompts x n (or beam_width) in one "
                                          "request; beyond: 400", group=LIMITS)
    max_chat_messages: int = option(DEFAULT_MAX_CHAT_MESSAGES, "most messages in one chat request; beyond: 400, "
                                    "before the template runs", group=LIMITS)
    max_prompt_chars: int = option(DEFAULT_MAX_PROMPT_CHARS, "most characters of one prompt (a chat as its template "
                                   "renders it, a text prompt); beyond: 400, before tokenizing", group=LIMITS)
    stage_threads: int = option(DEFAULT_STAGE_THREADS, "worker threads of each stage of a request's work off the "
                                "engine (parsing, chat templates, tokenizing, grammar, answers with logprobs), "
                                "each stage its own", group=LIMITS)
    stage_queue: int = option(DEFAULT_STAGE_QUEUE, "jobs of one such stage that may wait for its threads; beyond: "
                              "503 server_busy", group=LIMITS)
    allowed_origins: str = option("", "comma-separated origins allowed by CORS (default none: browsers cannot use "
                                  "the API)", group=LIMITS)
    allowed_hosts: str | None = option(None, "comma-separated Host header names accepted besides loopback ones "
                                       "(checked when bound to loopback, or whenever given; '*': any)", group=LIMITS)
    max_requests_per_key: int = option(DEFAULT_MAX_REQUESTS_PER_KEY, "requests (prompts) one API key may have "
                                       "waiting or running at once; beyond: 429 (0: no cap; with --api-key)",
                                       group=LIMITS)
    logprob_budget: int = option(DEFAULT_LOGPROB_BUDGET, "logprob entries (a token's k + 1, about 150 bytes of host "
                                 "memory each) all admitted requests may keep at once, generated (prompts x n x "
                                 "max_tokens x (k + 1)) and prompt logprobs; a request beyond what is free: 429, "
                                 "beyond all of it: 400 (0: no budget)", group=LIMITS)
    allow_client_priority: bool = option(False, "let requests set `priority` (--scheduling-policy priority); "
                                         "without it a non-zero priority is a 400", group=LIMITS)
    prefix_cache_per_key: bool = option(False, "separate prefix caches per API key (tenants never share cached "
                                        "blocks)", group=LIMITS)
    responses_store_size: int = option(DEFAULT_RESPONSES_STORE_SIZE, "Responses API: responses kept per API key "
                                       "for previous_response_id and GET /v1/responses/{id}, in memory (a restart "
                                       "clears them; 0: none kept)", group=LIMITS)
    responses_store_ttl: float = option(DEFAULT_RESPONSES_STORE_TTL, "Responses API: seconds a stored response is "
                                        "kept", group=LIMITS)
    reasoning_parser: str | None = option(None, "answer what the model thinks in <think>...</think> apart, as "
                                          "reasoning_content (deepseek_r1: the template opens the thought; qwen3: "
                                          "the output does)", choices=sorted(REASONING_PARSERS))
    thinking_token_budget: int | None = option(None, "default thinking budget of chat requests: after this many "
                                               "reasoning tokens `</think>` is forced (needs --reasoning-parser; a "
                                               "request's `thinking_token_budget` wins)")
    chat_template: str | None = option(None, "chat template for every model: a Jinja file, or a built-in name "
                                       "(hermes: ChatML with tools, for models whose own template knows none, e.g. "
                                       "SmolLM2)", group=TOOLS)
    tool_call_parser: str | None = option(None, "parse tool calls from the output in this format (default: the "
                                          "one matching each model's chat template)", choices=sorted(TOOL_PARSERS),
                                          group=TOOLS)
    enable_auto_tool_choice: bool = option(True, "the model chooses whether to call a tool (tool_choice \"auto\", "
                                           "the default with tools); --no-enable-auto-tool-choice: only calls the "
                                           "request forces (\"required\", a named function), as vLLM without "
                                           "--enable-auto-tool-choice", group=TOOLS)
    strict_request_fields: bool = option(False, "refuse requests with fields the server does not know (400) instead "
                                         "of naming them in the x-pagedlm-unknown-fields response header",
                                         group=LIMITS)
    health_step_timeout: float = option(DEFAULT_HEALTH_STEP_TIMEOUT, "/health answers 503 while one engine step has "
                                        "run longer than this many seconds with requests waiting (0: never)",
                                        group=LIMITS)
    shutdown_timeout: float = option(30.0, "on SIGTERM, seconds running requests may finish before they are ended "
                                     "with an error", group=LIMITS)
    ui: bool | None = option(None, "serve the memory views, read-only: the web view at /ui and GET /debug/state (for "
                             "`pagedlm top`), behind --api-key like the API (default: on when bound to a loopback "
                             "address, off otherwise)", group=UI)
    ui_show_text: bool = option(False, "the memory views show the sequences' and blocks' text (every API key sees "
                                "every tenant's, except tenants salted by --prefix-cache-per-key)", group=UI)
    config: str | None = option(None, "YAML file of these options (keys: option names without --); command-line "
                                "flags win", group=ROUTING)

    @property
    def serves_ui(self) -> bool:
        """--ui, or by default whether the bind address is loopback."""
        return self.ui if self.ui is not None else is_loopback(self.host)

    def __post_init__(self) -> None:
        check_choices(self)
        if min(self.max_body_bytes, self.max_prompts_per_request, self.max_chat_messages, self.max_prompt_chars,
               self.stage_threads) < 1:
            raise ValueError("--max-body-bytes, --max-prompts-per-request, --max-chat-messages, --max-prompt-chars "
                             "and --stage-threads must be >= 1.")
        if min(self.shutdown_timeout, self.health_step_timeout, self.request_read_timeout, self.max_connections,
               self.max_requests_per_key, self.stage_queue, self.logprob_budget) < 0:
            raise ValueError("--shutdown-timeout, --health-step-timeout, --request-read-timeout, --max-connections, "
                             "--max-requests-per-key, --stage-queue and --logprob-budget must be >= 0.")
        if self.thinking_token_budget is not None and (self.thinking_token_budget < 0 or not self.reasoning_parser):
            raise ValueError("--thinking-token-budget must be >= 0 and needs --reasoning-parser.")
        if self.responses_store_size < 0 or self.responses_store_ttl <= 0:
            raise ValueError("--responses-store-size must be >= 0 and --responses-store-ttl > 0.")
        for name, port in (("--port", self.port), ("--ollama-port", self.ollama_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0-65535, got {port}.")
        if self.ollama_port is not None and self.ollama_port == self.port != 0:
            raise ValueError(f"--ollama-port must differ from --port (both {self.port}).")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `pagedlm serve` runs with, typed: the engine settings every model gets (`engine`, whose `model`
    each served model replaces), the server's options, its engine loops', the router's and the replicas'."""

    engine: EngineConfig
    server: ServerConfig
    loop: LoopConfig
    router: RouterConfig
    parallel: ParallelConfig

    OPTIONS = (ServerConfig, LoopConfig, RouterConfig, ParallelConfig)  # their fields are the server's flags

    @classmethod
    def from_args(cls, args: argparse.Namespace, engine_kwargs: Callable[[argparse.Namespace], dict]) -> ServeConfig:
        """The parsed flags as configs (ValueError for a bad one). `engine_kwargs(args)` reads the engine flags."""
        engine = EngineConfig(**{**engine_kwargs(args), "model": DEFAULT_MODEL})
        server, loop, router, parallel = (c(**from_args(c, args)) for c in cls.OPTIONS)
        return cls(engine, server, loop, router, parallel)
