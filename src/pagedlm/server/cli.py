"""`pagedlm serve`: the OpenAI-compatible server (uvicorn), bound to 127.0.0.1:8000 unless told otherwise."""
from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Callable

from pagedlm.config import parse_bytes

logger = logging.getLogger("pagedlm.server")

API_KEY_ENV = "PAGEDLM_API_KEY"


def add_serve_parser(subparsers: argparse._SubParsersAction, engine_args_fn: Callable[[argparse.ArgumentParser], None],
                     engine_kwargs_fn: Callable[[argparse.Namespace], dict]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    engine_args_fn(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the URL is logged)")
    p.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer <key>` (or set ${API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    p.add_argument("--max-waiting", type=int, default=512,
                   help="requests allowed to wait for a slot; beyond it requests get 503 + Retry-After")
    p.add_argument("--max-body-bytes", type=_size, default=8 * 2**20,
                   help="largest request body, e.g. 8MiB (larger: 413)")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between throughput lines (0: off)")
    p.add_argument("--disable-access-log", action="store_true")
    p.set_defaults(fn=lambda args: serve(args, engine_kwargs_fn))
    return p


def serve(args: argparse.Namespace, engine_kwargs_fn: Callable[[argparse.Namespace], dict]) -> int:
    import uvicorn

    from pagedlm.engine.async_engine import AsyncLLMEngine
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.server.api import build_app

    if args.max_waiting < 1 or args.max_body_bytes < 1:
        raise ValueError("--max-waiting and --max-body-bytes must be >= 1.")
    kwargs = engine_kwargs_fn(args)
    sock = _bind(args.host, args.port)  # before loading the model: a busy port fails fast
    engine = LLMEngine.from_args(**kwargs)  # logs the KV memory report
    async_engine = AsyncLLMEngine(engine, max_waiting=args.max_waiting, log_interval=args.log_interval)
    try:
        name = args.served_model_name or kwargs["model"]
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        app = build_app(async_engine, name, api_key, args.max_body_bytes)
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        logger.info("Serving %s at %s (OpenAI API: %s/v1)%s", name, url, url,
                    ", API key required" if api_key else "")
        config = uvicorn.Config(app, log_config=None, access_log=not args.disable_access_log,
                                timeout_graceful_shutdown=5, timeout_keep_alive=30)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        async_engine.shutdown()
        sock.close()
    return 0


def _size(value: str) -> int:
    """Bytes: a plain integer, or a size such as 8MiB."""
    return int(value) if value.strip().isdigit() else parse_bytes(value)


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
