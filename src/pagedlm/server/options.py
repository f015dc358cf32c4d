"""`pagedlm serve`'s own options (the engine's are EngineConfig's): one `option` field per flag, which cli.py adds
to the parser and passes to the server."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagedlm.config import check_choices, from_args, option, parse_bytes
from pagedlm.server import (
    DEFAULT_HEALTH_STEP_TIMEOUT,
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


LIMITS, TOOLS = "limits and security (see docs/serving.md, *Limits and security*)", "tool calling"
ROUTING, REPLICAS = "several models and routing", "replicas (data parallelism on Ray)"


@dataclass
class ServerConfig:
    """The server's own options (the engine's are EngineConfig's), each a `pagedlm serve` flag of the same name."""

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
    max_waiting: int = option(512, "requests allowed to wait for a slot; beyond it requests get 503 + Retry-After")
    max_body_bytes: int = option(8 * 2**20, "largest request body, e.g. 8MiB (larger: 413)", parse=_size)
    log_interval: float = option(10.0, "seconds between throughput lines (0: off)")
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
    stage_threads: int = option(DEFAULT_STAGE_THREADS, "worker threads of each stage before the engine (parsing, "
                                "chat templates, tokenizing, grammar), each stage its own", group=LIMITS)
    stage_queue: int = option(DEFAULT_STAGE_QUEUE, "jobs of one such stage that may wait for its threads; beyond: "
                              "503 server_busy", group=LIMITS)
    stream_stall_timeout: float = option(60.0, "abort a request whose output nobody read for this many seconds, "
                                         "freeing its KV blocks (0: never)", group=LIMITS)
    allowed_origins: str = option("", "comma-separated origins allowed by CORS (default none: browsers cannot use "
                                  "the API)", group=LIMITS)
    allowed_hosts: str | None = option(None, "comma-separated Host header names accepted besides loopback ones "
                                       "(checked when bound to loopback, or whenever given; '*': any)", group=LIMITS)
    max_requests_per_key: int = option(DEFAULT_MAX_REQUESTS_PER_KEY, "requests (prompts) one API key may have "
                                       "waiting or running at once; beyond: 429 (0: no cap; with --api-key)",
                                       group=LIMITS)
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
    chat_template: str | None = option(None, "chat template for every model: a Jinja file, or a built-in name "
                                       "(hermes: ChatML with tools, for models whose own template knows none, e.g. "
                                       "SmolLM2)", group=TOOLS)
    tool_call_parser: str | None = option(None, "parse tool calls from the output in this format (default: the "
                                          "one matching each model's chat template)", choices=sorted(TOOL_PARSERS),
                                          group=TOOLS)
    strict_request_fields: bool = option(False, "refuse requests with fields the server does not know (400) instead "
                                         "of naming them in the x-pagedlm-unknown-fields response header",
                                         group=LIMITS)
    health_step_timeout: float = option(DEFAULT_HEALTH_STEP_TIMEOUT, "/health answers 503 while one engine step has "
                                        "run longer than this many seconds with requests waiting (0: never)",
                                        group=LIMITS)
    shutdown_timeout: float = option(30.0, "on SIGTERM, seconds running requests may finish before they are ended "
                                     "with an error", group=LIMITS)
    config: str | None = option(None, "YAML file of these options (keys: option names without --); command-line "
                                "flags win", group=ROUTING)
    router: str | None = option(None, "policy for requests to --router-name (default: heuristic with several "
                                "models, else none); cascade: the weak model answers first, unconfident answers are "
                                "re-run on the strong one", choices=("heuristic", "learned", "cascade", "none"),
                                group=ROUTING)
    cascade_threshold: float = option(-1.0, "cascade: re-run when the weak answer's mean token logprob is at or "
                                      "below this (the start point when --strong-fraction is given)", group=ROUTING)
    cascade_scorer: str = option("mean", "cascade: what judges the weak answer: mean (its mean token logprob), "
                                 "answer (its per-token logprob quantiles, minimum and length-normalised sum, and the "
                                 "agreement of --cascade-samples), or a file from `pagedlm router train-cascade`",
                                 group=ROUTING)
    cascade_samples: int = option(1, "cascade: samples of the weak answer drawn at once (n=k, sharing the prompt's "
                                  "KV blocks); their agreement feeds --cascade-scorer answer", group=ROUTING)
    router_name: str = option("auto", "model name that asks the router to choose", group=ROUTING)
    router_classifier: str | None = option(None, "router file from `pagedlm router train` (learned)", group=ROUTING)
    strong_model: list[str] | None = option(None, "a strong-tier model (repeatable; default: the last --model; the "
                                            "others are weak)", metavar="NAME", group=ROUTING)
    strong_fraction: float | None = option(None, "share of requests the quality policy sends strong, held on live "
                                           "traffic (learned router default 0.5; heuristic: only when given)",
                                           group=ROUTING)
    router_threshold: float | None = option(None, "fixed strong-score threshold (overrides --strong-fraction; "
                                            "heuristic default 0.5)", group=ROUTING)
    calibration_window: int = option(500, "recent requests whose scores set the live threshold (0: keep the offline "
                                     "threshold)", group=ROUTING)
    model_cost: list[str] | None = option(None, "price per 1M input and output tokens (cheapest model of a tier "
                                          "wins; repeatable)", metavar="NAME=IN,OUT", group=ROUTING)
    tier_share: list[str] | None = option(None, "one tier per model, cheapest first (by --model-cost): the share of "
                                          "requests this model's tier takes, held on live traffic (repeatable, one "
                                          "per model, summing to 1); harder requests go to pricier tiers",
                                          metavar="NAME=SHARE", group=ROUTING)
    max_ttft_ms: float | None = option(None, "SLO: predicted time to first token", group=ROUTING)
    max_tpot_ms: float | None = option(None, "SLO: recent time per output token", group=ROUTING)
    max_queue: int | None = option(None, "SLO: waiting requests at which a model is overloaded", group=ROUTING)
    max_request_cost: float | None = option(None, "SLO: predicted price of one request", group=ROUTING)
    max_cost_per_hour: float | None = option(None, "spend cap over the last hour, from --model-cost prices and the "
                                             "tokens used; near it requests go to cheaper models, past it they get "
                                             "429", group=ROUTING)
    max_cost_per_hour_per_key: float | None = option(None, "the same cap for each API key (--api-key)",
                                                     group=ROUTING)
    budget_near: float = option(0.8, "share of a spend cap from which requests go to cheaper models", group=ROUTING)
    data_parallel_size: int = option(1, "engine replicas per model, each a Ray actor on its share of the cores (1: "
                                     "the engine runs in this process)", aliases=("-dp",), group=REPLICAS)
    ray_address: str | None = option(None, "join this Ray cluster (e.g. ray://head:10001 or auto) instead of "
                                     "starting a local one", group=REPLICAS)
    replica_policy: str = option("prefix", "how requests are spread over replicas (prefix: the replica caching the "
                                 "longest prefix of the prompt, unless much busier)",
                                 choices=("prefix", "least-loaded", "round-robin"), group=REPLICAS)
    threads_per_replica: int | None = option(None, "torch threads (and CPUs reserved) per replica (default: the "
                                             "cluster's CPUs / replicas)", group=REPLICAS)
    replica_health_timeout: float = option(10.0, "a replica that does not answer a poll for this many seconds is "
                                           "taken out and restarted", group=REPLICAS)

    def __post_init__(self) -> None:
        check_choices(self)
        if min(self.max_waiting, self.max_body_bytes, self.max_prompts_per_request, self.max_chat_messages,
               self.max_prompt_chars, self.stage_threads) < 1:
            raise ValueError("--max-waiting, --max-body-bytes, --max-prompts-per-request, --max-chat-messages, "
                             "--max-prompt-chars and --stage-threads must be >= 1.")
        if min(self.stream_stall_timeout, self.shutdown_timeout, self.health_step_timeout,
               self.request_read_timeout, self.max_connections, self.max_requests_per_key, self.stage_queue) < 0:
            raise ValueError("--stream-stall-timeout, --shutdown-timeout, --health-step-timeout, "
                             "--request-read-timeout, --max-connections, --max-requests-per-key and --stage-queue "
                             "must be >= 0.")
        if self.responses_store_size < 0 or self.responses_store_ttl <= 0:
            raise ValueError("--responses-store-size must be >= 0 and --responses-store-ttl > 0.")
        if self.data_parallel_size < 1 or (self.threads_per_replica is not None and self.threads_per_replica < 1):
            raise ValueError("--data-parallel-size and --threads-per-replica must be >= 1.")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(**from_args(cls, args))
