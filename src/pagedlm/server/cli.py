"""`pagedlm serve`: the OpenAI-compatible server (uvicorn), bound to 127.0.0.1:8000 unless told otherwise.

`--model` may be repeated (`NAME=MODEL` names one): every model gets its own engine (and its own KV budget) in
one server; with more than one, requests for `--router-name` (`auto`) are routed among them.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pagedlm.config import RouterConfig, add_arguments
from pagedlm.server.options import API_KEY_ENV, ServeConfig, ServerConfig, is_loopback
from pagedlm.server.tools import BUILTIN_TEMPLATES

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["API_KEY_ENV", "ServeConfig", "ServerConfig", "add_serve_parser", "apply_config", "serve",
           "served_app"]

logger = logging.getLogger("pagedlm.server")


def add_serve_parser(subparsers: argparse._SubParsersAction, engine_args_fn: Callable[..., None],
                     engine_kwargs_fn: Callable[[argparse.Namespace], dict]) -> argparse.ArgumentParser:
    """`engine_args_fn(parser, multi_model=True)` adds the engine flags with a repeatable `--model`; the fields of
    ServeConfig's option classes add the server's, the loops', the router's and the replicas'."""
    p = subparsers.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model to serve, as a first --model (as in "
                   "`vllm serve MODEL`)")
    engine_args_fn(p, multi_model=True)
    for cls in ServeConfig.OPTIONS:
        add_arguments(p, cls)
    p.set_defaults(fn=lambda args: cmd_serve(args, engine_kwargs_fn, p))
    return p


def cmd_serve(args: argparse.Namespace, engine_kwargs_fn: Callable[[argparse.Namespace], dict],
              parser: argparse.ArgumentParser | None = None) -> int:
    """The flags (and their YAML file) read into a ServeConfig and the models to serve; bad ones fail here."""
    if args.config:
        apply_config(args, parser, args.config)
    if getattr(args, "model_tag", None):
        args.model = [args.model_tag, *(args.model or [])]
    cfg = ServeConfig.from_args(args, engine_kwargs_fn)
    return serve(cfg, model_specs(args.model, cfg.server.served_model_name))


def serve(cfg: ServeConfig, models: list[tuple[str, str]]) -> int:
    """Serve `models` ((served name, model) pairs) with `cfg` until SIGTERM / SIGINT."""
    from pagedlm.server.http import ensure_open_files, uvicorn_config
    from pagedlm.server.shutdown import GracefulServer

    srv = cfg.server
    sock = _bind(srv.host, srv.port)  # before loading the models: a busy port fails fast
    second = ollama_socket(srv.host, srv.ollama_port)
    try:
        with served_app(cfg, models) as (app, names):
            url = _url(sock)
            logger.info("Serving %s at %s (OpenAI API: %s/v1)%s%s", ", ".join(names), url, url,
                        ", API key required" if resolve_api_keys(srv) else "",
                        f"; memory view: {url}/ui" if srv.serves_ui else "")
            if second is not None:
                logger.info("Ollama's port: the same API at %s", _url(second))
            config = uvicorn_config(app, max_connections=srv.max_connections,
                                    request_read_timeout=srv.request_read_timeout,
                                    access_log=not srv.disable_access_log, shutdown_timeout=srv.shutdown_timeout)
            ensure_open_files(srv.max_connections)
            GracefulServer(config, app.state.frontend, srv.shutdown_timeout).run(
                sockets=[sock] if second is None else [sock, second])
    finally:
        sock.close()
        if second is not None:
            second.close()
    return 0


@contextmanager
def served_app(cfg: ServeConfig, models: list[tuple[str, str]]) -> Iterator[tuple[FastAPI, list[str]]]:
    """The app over `models` ((served name, model) pairs) as `cfg` asks, with the names it serves; its engines
    (and the router's dispatcher, the embedding models) are shut down on leaving."""
    from dataclasses import replace

    from pagedlm.engine.async_engine import AsyncLLMEngine
    from pagedlm.engine.client import EngineClient
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.server.api import build_app
    from pagedlm.server.dispatch import Dispatcher
    from pagedlm.server.limits import RequestLimits

    srv, loop, parallel = cfg.server, cfg.loop, cfg.parallel
    api_keys = resolve_api_keys(srv)
    router = build_router(cfg.router, [name for name, _ in models], api_keys)
    template = chat_template(srv.chat_template)
    engines: dict[str, EngineClient] = {}
    embedders: dict = {}
    dispatcher = None
    try:
        for spec in srv.embedding_model or []:
            from pagedlm.engine.embedding_engine import EmbeddingEngine

            name, sep, target = spec.partition("=")
            name, target = (name, target) if sep and name and "/" not in name else (spec, spec)
            logger.info("Loading the embedding model %s (%s)", name, target)
            embedders[name] = EmbeddingEngine(target, max_waiting=loop.max_waiting)
        for name, target in models:
            engine_config = replace(cfg.engine, model=target)  # bad flags fail here, not in every actor
            logger.info("Loading %s (%s)", name, target)
            if parallel.replicated:
                from pagedlm.dp.launch import launch_replica_set

                engines[name] = launch_replica_set(engine_config, parallel, loop)
                continue
            engine = LLMEngine(engine_config)  # logs the KV memory report
            if template is not None:
                engine.tokenizer.hf.chat_template = template
            engines[name] = AsyncLLMEngine(engine, loop)
        if router is not None:
            dispatcher = Dispatcher(router, engines, cfg.router.router_name)
            dispatcher.warm_up()
            logger.info("Routing `%s` with %s", dispatcher.name, describe_router(router))
        if srv.prefix_cache_per_key and not api_keys:
            logger.warning("--prefix-cache-per-key does nothing without API keys")
        app = build_app(engines, api_keys, srv.max_body_bytes, dispatcher,
                        max_prompts_per_request=srv.max_prompts_per_request,
                        allowed_origins=_names(srv.allowed_origins), allowed_hosts=allowed_hosts(srv),
                        prefix_cache_per_key=srv.prefix_cache_per_key,
                        strict_request_fields=srv.strict_request_fields, tool_call_parser=srv.tool_call_parser,
                        auto_tool_choice=srv.enable_auto_tool_choice,
                        health_step_timeout=srv.health_step_timeout,
                        max_requests_per_key=srv.max_requests_per_key,
                        allow_client_priority=srv.allow_client_priority,
                        limits=RequestLimits(srv.max_chat_messages, srv.max_prompt_chars),
                        stage_threads=srv.stage_threads, stage_queue=srv.stage_queue,
                        responses_store_size=srv.responses_store_size,
                        responses_store_ttl=srv.responses_store_ttl, embedders=embedders,
                        reasoning_parser=srv.reasoning_parser, thinking_token_budget=srv.thinking_token_budget,
                        ui=srv.serves_ui, ui_show_text=srv.ui_show_text, logprob_budget=srv.logprob_budget,
                        embedding_pooling=srv.embedding_pooling)
        yield app, [*engines, *([dispatcher.name] if dispatcher else []), *embedders]
    finally:
        if dispatcher is not None:
            dispatcher.shutdown()
        for engine in reversed(engines.values()):  # the first replica set stops a Ray it started: last
            engine.shutdown()
        for embedder in embedders.values():
            embedder.shutdown()


def ollama_socket(host: str, port: int | None) -> socket.socket | None:
    """The second listening socket of --ollama-port (None: not asked for)."""
    return None if port is None else _bind(host, port)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def resolve_api_keys(srv: ServerConfig) -> list[str]:
    """The keys of --api-key, else of $PAGEDLM_API_KEY (comma-separated); ValueError on an empty one (an unset
    shell variable in `--api-key "$KEY"` would otherwise turn authentication off)."""
    if srv.api_key is not None:
        keys, source = srv.api_key, "--api-key"
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


def allowed_hosts(srv: ServerConfig) -> list[str] | None:
    """The Host names to accept besides loopback ones, or None (no check): bound to a loopback address, the
    check is on (DNS rebinding); bound elsewhere, only when --allowed-hosts is given."""
    if srv.allowed_hosts is not None:
        return _names(srv.allowed_hosts)
    return [] if is_loopback(srv.host) else None


def model_specs(model: list[str] | None, served_model_name: str | None = None) -> list[tuple[str, str]]:
    """(served name, model) per `--model` (`NAME=MODEL` or `MODEL`, named as given); default: the default model."""
    from pagedlm.config import DEFAULT_MODEL

    specs = []
    for spec in model or [DEFAULT_MODEL]:
        name, sep, target = spec.partition("=")
        if not sep or not name or "/" in name or not target:
            name, target = spec, spec
        specs.append((name, target))
    if served_model_name:
        if len(specs) != 1:
            raise ValueError("--served-model-name needs exactly one --model (name several with NAME=MODEL).")
        specs = [(served_model_name, specs[0][1])]
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"Model names must be distinct: {names}")
    return specs


def build_router(cfg: RouterConfig, names: list[str], api_keys: list[str] = ()):
    """The `Router` `cfg` asks for over the models `names`, or None (one model and no --router, or --router
    none)."""
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

    kind = cfg.kind(len(names))
    if kind == "none":
        return None
    if cfg.router_name in names:
        raise ValueError(f"--router-name {cfg.router_name!r} is also a model name.")
    strong = set(cfg.strong_model or names[-1:])
    if not strong <= set(names):
        raise ValueError(f"--strong-model {sorted(strong - set(names))} is not a served model ({names}).")
    costs = dict(_cost(spec, names) for spec in cfg.model_cost or [])
    entries = [ModelEntry(n, n in strong, *costs.get(n, (0.0, 0.0))) for n in names]
    if kind == "learned":
        if not cfg.router_classifier:
            raise ValueError("--router learned needs --router-classifier FILE (from `pagedlm router train`).")
        from pagedlm.router.classifier import WeakCorrectClassifier

        clf = WeakCorrectClassifier.load(cfg.router_classifier)
        fraction = 0.5 if cfg.strong_fraction is None else cfg.strong_fraction
        policy = ClassifierPolicy(clf, fraction, cfg.router_threshold)
        reference = clf.train_scores
    elif kind == "cascade":
        from pagedlm.router import EscalationScorer

        fraction, reference = cfg.strong_fraction, None
        scorer = {"mean": EscalationScorer.mean_logprob, "answer": EscalationScorer.prior}.get(
            cfg.cascade_scorer, lambda: EscalationScorer.load(cfg.cascade_scorer))()
        policy = CascadePolicy(cfg.cascade_threshold, scorer, cfg.cascade_samples)
    else:
        fraction = cfg.strong_fraction
        policy = HeuristicPolicy(0.5 if cfg.router_threshold is None else cfg.router_threshold)
        reference = None
    if cfg.tier_share:
        from pagedlm.router.tiers import TieredPolicy, parse_tier_shares, tiered_entries

        if kind == "cascade" or cfg.strong_fraction is not None or cfg.router_threshold is not None \
                or cfg.strong_model:
            raise ValueError("--tier-share sets every tier's share: it takes --router heuristic or learned, without "
                             "--strong-fraction, --router-threshold or --strong-model.")
        entries, shares = tiered_entries(names, costs, parse_tier_shares(cfg.tier_share, names))
        policy, fraction = TieredPolicy(policy, shares, reference), None
        if cfg.calibration_window:
            policy.calibrate_live(window=cfg.calibration_window, min_samples=min(50, cfg.calibration_window))
    if fraction is not None and cfg.router_threshold is None and cfg.calibration_window:
        policy.calibrate_live(fraction, reference=reference, window=cfg.calibration_window,
                              min_samples=min(50, cfg.calibration_window))
    limits = (cfg.max_ttft_ms, cfg.max_tpot_ms, cfg.max_queue, cfg.max_request_cost)
    slo = None
    if any(v is not None for v in limits):
        slo = SLO(ttft_s=_seconds(cfg.max_ttft_ms), tpot_s=_seconds(cfg.max_tpot_ms),
                  max_cost=cfg.max_request_cost, max_queue=cfg.max_queue)
    limits = BudgetLimits(cfg.max_cost_per_hour, cfg.max_cost_per_hour_per_key, cfg.budget_near)
    if limits.active and not any(m.cost_per_input_token or m.cost_per_output_token for m in entries):
        raise ValueError("--max-cost-per-hour needs prices: --model-cost NAME=IN,OUT")
    if limits.max_cost_per_hour_per_key is not None and not api_keys:
        logger.warning("--max-cost-per-hour-per-key does nothing without API keys")
    window = cfg.calibration_window or 500
    return Router(entries, policy, slo, budget=SpendLedger(limits) if limits.active else None, share_window=window)


def describe_router(router) -> str:
    shares = getattr(router.policy, "shares", None)
    kinds = {m.name: f"tier {m.rank}, {shares[m.rank]:.0%}" if shares else "strong" if m.strong else "weak"
             for m in router.models.values()}
    models = ", ".join(f"{name} ({kind})" for name, kind in kinds.items())
    cal = router.calibrator
    live = f", live calibration to {cal.target:.0%} strong over {cal.window} requests" if cal else ""
    budget = f", budget {router.budget.limits}" if router.budget else ""
    return f"{type(router.policy).__name__} (threshold {router.policy.threshold:.3f}{live}) over {models}" + (
        f", SLO {router.slo}" if router.slo else "") + budget


def apply_config(args: argparse.Namespace, parser: argparse.ArgumentParser | None, path: str) -> None:
    """Fill options left at their defaults from a YAML mapping of option names (`max-ttft-ms: 500`). List
    options take a list or a mapping: `model: {small: smollm2-135m}`, `model-cost: {small: [0.1, 0.2]}`."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
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
            try:
                value = action.type(value)  # as the flag parses it: `max-body-bytes: 8MiB`
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{path}: {key}: {e}") from None
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
