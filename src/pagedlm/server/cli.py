"""`pagedlm serve`: the OpenAI-compatible server (uvicorn), bound to 127.0.0.1:8000 unless told otherwise.

`--model` may be repeated (`NAME=MODEL` names one): every model gets its own engine (and its own KV budget) in
one server; with more than one, requests for `--router-name` (`auto`) are routed among them.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedlm.config import add_arguments, check_choices, from_args, option, parse_bytes
from pagedlm.server import DEFAULT_HEALTH_STEP_TIMEOUT, DEFAULT_MAX_PROMPTS_PER_REQUEST
from pagedlm.server.tools import BUILTIN_TEMPLATES, TOOL_PARSERS

logger = logging.getLogger("pagedlm.server")

API_KEY_ENV = "PAGEDLM_API_KEY"


def _size(value: str) -> int:
    """Bytes: a plain integer, or a size such as 8MiB."""
    return int(value) if value.strip().isdigit() else parse_bytes(value)


LIMITS, TOOLS = "limits and security (see README, *Limits and security*)", "tool calling"
ROUTING, REPLICAS = "several models and routing", "replicas (data parallelism on Ray)"


@dataclass
class ServerConfig:
    """The server's own options (the engine's are EngineConfig's), each a `pagedlm serve` flag of the same name."""

    host: str = option("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = option(8000, "port (0: any free port; the URL is logged)")
    api_key: list[str] | None = option(None, "require `Authorization: Bearer <key>` (repeatable: one key per tenant; "
                                       f"or set ${API_KEY_ENV}, comma-separated)")
    served_model_name: str | None = option(None, "model name clients use (default: --model; one model)")
    max_waiting: int = option(512, "requests allowed to wait for a slot; beyond it requests get 503 + Retry-After")
    max_body_bytes: int = option(8 * 2**20, "largest request body, e.g. 8MiB (larger: 413)", parse=_size)
    log_interval: float = option(10.0, "seconds between throughput lines (0: off)")
    disable_access_log: bool = option(False, "do not log each request")
    max_prompts_per_request: int = option(DEFAULT_MAX_PROMPTS_PER_REQUEST, "most prompts x n (or beam_width) in one "
                                          "request; beyond: 400", group=LIMITS)
    stream_stall_timeout: float = option(60.0, "abort a request whose output nobody read for this many seconds, "
                                         "freeing its KV blocks (0: never)", group=LIMITS)
    allowed_origins: str = option("", "comma-separated origins allowed by CORS (default none: browsers cannot use "
                                  "the API)", group=LIMITS)
    allowed_hosts: str | None = option(None, "comma-separated Host header names accepted besides loopback ones "
                                       "(checked when bound to loopback, or whenever given; '*': any)", group=LIMITS)
    prefix_cache_per_key: bool = option(False, "separate prefix caches per API key (tenants never share cached "
                                        "blocks)", group=LIMITS)
    chat_template: str | None = option(None, "chat template for every model: a Jinja file, or a built-in name "
                                       "(hermes: ChatML with tools, for models whose own template knows none, e.g. "
                                       "SmolLM2)", group=TOOLS)
    tool_call_parser: str | None = option(None, "parse tool calls from the output in this format (needed for "
                                          "`tools`)", choices=sorted(TOOL_PARSERS), group=TOOLS)
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
        if self.max_waiting < 1 or self.max_body_bytes < 1 or self.max_prompts_per_request < 1:
            raise ValueError("--max-waiting, --max-body-bytes and --max-prompts-per-request must be >= 1.")
        if min(self.stream_stall_timeout, self.shutdown_timeout, self.health_step_timeout) < 0:
            raise ValueError("--stream-stall-timeout, --shutdown-timeout and --health-step-timeout must be >= 0.")
        if self.data_parallel_size < 1 or (self.threads_per_replica is not None and self.threads_per_replica < 1):
            raise ValueError("--data-parallel-size and --threads-per-replica must be >= 1.")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerConfig":
        return cls(**from_args(cls, args))


def add_serve_parser(subparsers: argparse._SubParsersAction, engine_args_fn: Callable[..., None],
                     engine_kwargs_fn: Callable[[argparse.Namespace], dict]) -> argparse.ArgumentParser:
    """`engine_args_fn(parser, multi_model=True)` adds the engine flags with a repeatable `--model`; ServerConfig's
    fields add the server's."""
    p = subparsers.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    engine_args_fn(p, multi_model=True)
    add_arguments(p, ServerConfig)
    p.set_defaults(fn=lambda args: serve(args, engine_kwargs_fn, p))
    return p


def serve(args: argparse.Namespace, engine_kwargs_fn: Callable[[argparse.Namespace], dict],
          parser: argparse.ArgumentParser | None = None) -> int:
    import uvicorn

    from pagedlm.engine.async_engine import AsyncLLMEngine
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.server.api import build_app
    from pagedlm.server.routing import AutoRoute
    from pagedlm.server.shutdown import GracefulServer

    if args.config:
        apply_config(args, parser, args.config)
    ServerConfig.from_args(args)  # bad server options fail here
    replicated = args.data_parallel_size > 1 or args.ray_address is not None
    models = model_specs(args)
    router = build_router(args, [name for name, _ in models])
    template = chat_template(args.chat_template)
    api_keys = resolve_api_keys(args)
    sock = _bind(args.host, args.port)  # before loading the models: a busy port fails fast
    engines: dict[str, AsyncLLMEngine] = {}
    route = None
    try:
        for name, target in models:
            kwargs = engine_kwargs_fn(argparse.Namespace(**{**vars(args), "model": target}))
            logger.info("Loading %s (%s)", name, target)
            if replicated:
                from pagedlm.config import EngineConfig
                from pagedlm.router.replicas import ReplicaSet

                EngineConfig(**kwargs)  # bad flags fail here, not in every actor
                engines[name] = ReplicaSet.launch(
                    kwargs, args.data_parallel_size, ray_address=args.ray_address, policy=args.replica_policy,
                    num_threads=args.threads_per_replica, max_waiting=args.max_waiting,
                    stall_timeout=args.stream_stall_timeout, log_interval=args.log_interval,
                    health_timeout=args.replica_health_timeout)
                continue
            engine = LLMEngine.from_args(**kwargs)  # logs the KV memory report
            if template is not None:
                engine.tokenizer.hf.chat_template = template
            engines[name] = AsyncLLMEngine(engine, max_waiting=args.max_waiting, log_interval=args.log_interval,
                                           stall_timeout=args.stream_stall_timeout)
        if router is not None:
            route = AutoRoute(router, engines, args.router_name)
            route.warm_up()
        if args.prefix_cache_per_key and not api_keys:
            logger.warning("--prefix-cache-per-key does nothing without API keys")
        app = build_app(engines, api_keys, args.max_body_bytes, route,
                        max_prompts_per_request=args.max_prompts_per_request,
                        allowed_origins=_names(args.allowed_origins), allowed_hosts=allowed_hosts(args),
                        prefix_cache_per_key=args.prefix_cache_per_key,
                        strict_request_fields=args.strict_request_fields, tool_call_parser=args.tool_call_parser,
                        health_step_timeout=args.health_step_timeout)
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        served = ", ".join([*engines, *([route.name] if route else [])])
        logger.info("Serving %s at %s (OpenAI API: %s/v1)%s", served, url, url,
                    ", API key required" if api_keys else "")
        if route is not None:
            logger.info("Routing `%s` with %s", route.name, describe_router(router))
        config = uvicorn.Config(app, log_config=None, access_log=not args.disable_access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout + 5, timeout_keep_alive=30)
        GracefulServer(config, app.state.server, args.shutdown_timeout).run(sockets=[sock])
    finally:
        if route is not None:
            route.shutdown()
        for engine in reversed(engines.values()):  # the first replica set stops a Ray it started: last
            engine.shutdown()
        sock.close()
    return 0


def resolve_api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of --api-key, else of $PAGEDLM_API_KEY (comma-separated); ValueError on an empty one (an unset
    shell variable in `--api-key "$KEY"` would otherwise turn authentication off)."""
    if args.api_key is not None:
        keys, source = args.api_key, "--api-key"
    elif API_KEY_ENV in os.environ:
        keys, source = [k.strip() for k in os.environ[API_KEY_ENV].split(",")], f"${API_KEY_ENV}"
    else:
        return []
    if not all(k.strip() for k in keys):
        raise ValueError(f"{source} holds an empty API key: give non-empty keys (or none to serve without one).")
    return keys


def _names(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def chat_template(value: str | None) -> str | None:
    """--chat-template: a built-in template's name, or a Jinja file."""
    if value is None or value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES.get(value)
    try:
        return Path(value).read_text()
    except OSError as e:
        raise SystemExit(f"--chat-template: not a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                         f"nor a readable file: {e}") from None


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """The Host names to accept besides loopback ones, or None (no check): bound to a loopback address, the
    check is on (DNS rebinding); bound elsewhere, only when --allowed-hosts is given."""
    if args.allowed_hosts is not None:
        return _names(args.allowed_hosts)
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    return [] if loopback else None


def model_specs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(served name, model) per `--model` (`NAME=MODEL` or `MODEL`, named as given); default: the default model."""
    from pagedlm.config import DEFAULT_MODEL

    specs = []
    for spec in args.model or [DEFAULT_MODEL]:
        name, sep, target = spec.partition("=")
        if not sep or not name or "/" in name or not target:
            name, target = spec, spec
        specs.append((name, target))
    if args.served_model_name:
        if len(specs) != 1:
            raise ValueError("--served-model-name needs exactly one --model (name several with NAME=MODEL).")
        specs = [(args.served_model_name, specs[0][1])]
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"Model names must be distinct: {names}")
    return specs


def build_router(args: argparse.Namespace, names: list[str]):
    """The `Router` the flags ask for, or None (one model and no --router, or --router none)."""
    from pagedlm.router import (
        SLO,
        BudgetLimits,
        CascadePolicy,
        ClassifierPolicy,
        HeuristicPolicy,
        ModelEntry,
        Router,
        SpendLedger,
    )

    kind = args.router or ("heuristic" if len(names) > 1 else "none")
    if kind == "none":
        return None
    if args.router_name in names:
        raise ValueError(f"--router-name {args.router_name!r} is also a model name.")
    strong = set(args.strong_model or names[-1:])
    if not strong <= set(names):
        raise ValueError(f"--strong-model {sorted(strong - set(names))} is not a served model ({names}).")
    costs = dict(_cost(spec, names) for spec in args.model_cost or [])
    entries = [ModelEntry(n, n in strong, *costs.get(n, (0.0, 0.0))) for n in names]
    if kind == "learned":
        if not args.router_classifier:
            raise ValueError("--router learned needs --router-classifier FILE (from `pagedlm router train`).")
        from pagedlm.router.classifier import WeakCorrectClassifier

        clf = WeakCorrectClassifier.load(args.router_classifier)
        fraction = 0.5 if args.strong_fraction is None else args.strong_fraction
        policy = ClassifierPolicy(clf, fraction, args.router_threshold)
        reference = clf.train_scores
    elif kind == "cascade":
        fraction, reference = args.strong_fraction, None
        policy = CascadePolicy(args.cascade_threshold)
    else:
        fraction = args.strong_fraction
        policy = HeuristicPolicy(0.5 if args.router_threshold is None else args.router_threshold)
        reference = None
    if args.calibration_window < 0:
        raise ValueError("--calibration-window must be >= 0.")
    if fraction is not None and args.router_threshold is None and args.calibration_window:
        policy.calibrate_live(fraction, reference=reference, window=args.calibration_window,
                              min_samples=min(50, args.calibration_window))
    limits = (args.max_ttft_ms, args.max_tpot_ms, args.max_queue, args.max_request_cost)
    slo = None
    if any(v is not None for v in limits):
        slo = SLO(ttft_s=_seconds(args.max_ttft_ms), tpot_s=_seconds(args.max_tpot_ms),
                  max_cost=args.max_request_cost, max_queue=args.max_queue)
    limits = BudgetLimits(args.max_cost_per_hour, args.max_cost_per_hour_per_key, args.budget_near)
    if limits.active and not any(m.cost_per_input_token or m.cost_per_output_token for m in entries):
        raise ValueError("--max-cost-per-hour needs prices: --model-cost NAME=IN,OUT")
    if limits.max_cost_per_hour_per_key is not None and not (args.api_key or os.environ.get(API_KEY_ENV)):
        logger.warning("--max-cost-per-hour-per-key does nothing without API keys")
    window = args.calibration_window or 500
    return Router(entries, policy, slo, budget=SpendLedger(limits) if limits.active else None, share_window=window)


def describe_router(router) -> str:
    models = ", ".join(f"{m.name} ({'strong' if m.strong else 'weak'})" for m in router.models.values())
    cal = router.calibrator
    live = f", live calibration to {cal.target:.0%} strong over {cal.window} requests" if cal else ""
    budget = f", budget {router.budget.limits}" if router.budget else ""
    return f"{type(router.policy).__name__} (threshold {router.policy.threshold:.3f}{live}) over {models}" + (
        f", SLO {router.slo}" if router.slo else "") + budget


def apply_config(args: argparse.Namespace, parser: argparse.ArgumentParser | None, path: str) -> None:
    """Fill options left at their defaults from a YAML mapping of option names (`max-ttft-ms: 500`). List
    options take a list or a mapping: `model: {small: smollm2-135m}`, `model-cost: {small: [0.1, 0.2]}`."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values")  # noqa: TRY004 - CLI error
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest in ("config", "fn") or not hasattr(args, dest):
            raise ValueError(f"{path}: unknown option {key!r}")
        action = _actions(parser).get(dest)
        if dest in ("model", "strong_model", "model_cost") or isinstance(action, argparse._AppendAction):
            if isinstance(value, dict):
                value = [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in value.items()]
            elif not isinstance(value, list):
                value = [value]
            value = [str(v) for v in value]
        elif action is not None and action.type is not None and isinstance(value, str):
            value = action.type(value)  # as the flag parses it: `max-body-bytes: 8MiB`
        default = parser.get_default(dest) if parser is not None else None
        if getattr(args, dest) == default:
            setattr(args, dest, value)


def _actions(parser: argparse.ArgumentParser | None) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions} if parser is not None else {}


def _cost(spec: str, names: list[str]) -> tuple[str, tuple[float, float]]:
    name, _, prices = spec.partition("=")
    parts = prices.split(",")
    if name not in names or len(parts) != 2:
        raise ValueError(f"--model-cost {spec!r}: expected NAME=IN,OUT with NAME one of {names}")
    try:
        return name, (float(parts[0]) / 1e6, float(parts[1]) / 1e6)
    except ValueError:
        raise ValueError(f"--model-cost {spec!r}: prices must be numbers") from None


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"Cannot bind {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock
