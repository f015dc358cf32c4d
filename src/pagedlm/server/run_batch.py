"""`pagedlm run-batch -i requests.jsonl -o results.jsonl [MODEL]`: a file of requests in OpenAI's batch format (as
`vllm run-batch` reads it) run offline through the same app `pagedlm serve` serves, called in process (no socket):
every request is checked, limited, routed and answered exactly as the server would, with continuous batching
across the file.

An input line is `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`, the URL one
of `BATCH_URLS`. Each line gets one output line, in the input's order:
`{"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "...", "body": {...}},
"error": null}`. A request the API refuses keeps its status and the API's error body in `response`, and its
`error` is `{"code", "message"}`; a line that is no request (not a JSON object, no `custom_id` or one seen before,
another method or URL, `stream` asked for, longer than --max-body-bytes) gets `"response": null` and an `error`
naming the line. The file is read and written as it goes: at most `window` requests are running or waiting to be
written, whatever the file's length.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from pagedlm.config import LoopConfig, ParallelConfig, RouterConfig, add_arguments
from pagedlm.server.options import ServeConfig, ServerConfig

logger = logging.getLogger("pagedlm.server")

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
RETRY_STATUSES = (429, 503)  # a full queue or a spent logprob budget: the requests before it make room
MAX_RETRIES = 30
NETWORK_OPTIONS = ("host", "port", "ollama_port", "api_key", "disable_access_log", "max_connections",
                   "request_read_timeout", "allowed_origins", "allowed_hosts", "max_requests_per_key",
                   "prefix_cache_per_key", "health_step_timeout", "shutdown_timeout", "ui", "ui_show_text")


class LineError(ValueError):
    """A line that is not a batch request; `code` is the output's error code."""

    def __init__(self, message: str, code: str = "invalid_request", custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.custom_id = code, custom_id


@dataclass
class BatchRequest:
    custom_id: str
    url: str
    body: bytes


@dataclass
class BatchSummary:
    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"{self.requests} requests: {self.succeeded} succeeded, {self.failed} failed; "
                f"{self.prompt_tokens} prompt and {self.completion_tokens} completion tokens in "
                f"{self.seconds:.1f} s ({rate:.1f} completion tok/s)")


def parse_line(text: str, line_no: int, seen: set[str]) -> BatchRequest:
    """The request on input line `line_no`, or LineError; `seen` (the custom ids so far) gains its id."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(f"line {line_no} is not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(item, dict):
        raise LineError(f"line {line_no} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f"line {line_no}: `custom_id` must be a non-empty string")
    if custom_id in seen:
        raise LineError(f"line {line_no}: `custom_id` {custom_id!r} was used by an earlier line", "duplicate_custom_id",
                        custom_id)
    seen.add(custom_id)
    if item.get("method", "POST") != "POST":
        raise LineError(f"line {line_no}: `method` must be POST", custom_id=custom_id)
    url = item.get("url")
    if url not in BATCH_URLS:
        raise LineError(f"line {line_no}: `url` must be one of {', '.join(BATCH_URLS)}, got {url!r}",
                        "unsupported_url", custom_id)
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineError(f"line {line_no}: `body` must be a JSON object", custom_id=custom_id)
    if body.get("stream"):
        raise LineError(f"line {line_no}: a batch request cannot stream (`stream` must be false)",
                        custom_id=custom_id)
    return BatchRequest(custom_id, url, json.dumps(body).encode())


async def call_app(app: Callable, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` (JSON) to `path` of the ASGI `app` as a loopback client would; its status and body."""
    finished = asyncio.Event()
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    status, chunks = 500, []

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await finished.wait()  # the client stays connected until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                finished.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), (b"user-agent", b"pagedlm-run-batch")],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return status, b"".join(chunks)


@dataclass
class OrderedWriter:
    """Writes each index's record once every record before it is written; each record written frees a slot of
    `window` (so records held back and requests running together never exceed it)."""

    out: TextIO
    window: asyncio.Semaphore
    next_index: int = 0
    held: dict[int, dict] = field(default_factory=dict)

    def put(self, index: int, record: dict) -> None:
        self.held[index] = record
        while self.next_index in self.held:
            self.out.write(json.dumps(self.held.pop(self.next_index), ensure_ascii=False) + "\n")
            self.next_index += 1
            self.window.release()
        self.out.flush()


def _record(custom_id: str | None, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


async def run_request(app: Callable, req: BatchRequest, summary: BatchSummary) -> dict:
    """One request through the app, retried while the server is full (429 / 503); its output record."""
    for attempt in range(MAX_RETRIES + 1):
        status, raw = await call_app(app, req.url, req.body)
        if status not in RETRY_STATUSES or attempt == MAX_RETRIES:
            break
        await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
    try:
        body: Any = json.loads(raw)
    except ValueError:
        body = raw.decode(errors="replace")
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    response = {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body}
    if status == 200:
        summary.succeeded += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):
            summary.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
            summary.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        return _record(req.custom_id, response, None)
    summary.failed += 1
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {"message": str(body)}
    return _record(req.custom_id, response, {"code": err.get("code") or err.get("type") or str(status),
                                             "message": err.get("message", "")})


def read_lines(source: TextIO, limit: int):
    """(line number, text) per non-blank line of `source`; a line over `limit` characters is (number, None), the
    rest of it skipped."""
    line_no = 0
    while True:
        text = source.readline(limit + 1)
        if not text:
            return
        line_no += 1
        if len(text) > limit and not text.endswith("\n"):
            while (rest := source.readline(1 << 20)) and not rest.endswith("\n"):
                pass
            yield line_no, None
        elif text.strip():
            yield line_no, text


async def run_batch(app: Callable, source: TextIO, out: TextIO, *, window: int = 512,
                    max_line_chars: int = 8 * 2**20, progress: Callable[[], None] = lambda: None) -> BatchSummary:
    """Answer every request line of `source` with `app`, writing one output record per line to `out` in order."""
    summary, seen, tasks = BatchSummary(), set(), set()
    slots = asyncio.Semaphore(window)
    writer = OrderedWriter(out, slots)
    start = time.perf_counter()
    lines = read_lines(source, max_line_chars)

    async def answer(index: int, req: BatchRequest) -> None:
        writer.put(index, await run_request(app, req, summary))
        progress()

    index = 0
    while (item := await asyncio.to_thread(next, lines, None)) is not None:
        line_no, text = item
        await slots.acquire()
        summary.requests += 1
        try:
            if text is None:
                raise LineError(f"line {line_no} is longer than {max_line_chars} characters", "line_too_long")
            req = parse_line(text, line_no, seen)
        except LineError as e:
            summary.failed += 1
            writer.put(index, _record(e.custom_id, None, {"code": e.code, "message": str(e), "line": line_no}))
            progress()
        else:
            task = asyncio.create_task(answer(index, req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        index += 1
    if tasks:
        await asyncio.gather(*tasks)
    summary.seconds = time.perf_counter() - start
    return summary


def add_run_batch_parser(subparsers: argparse._SubParsersAction, engine_args_fn: Callable[..., None],
                         engine_kwargs_fn: Callable[[argparse.Namespace], dict]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("run-batch", help="answer a file of requests in OpenAI's batch format",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line (- : stdin)")
    p.add_argument("-o", "--output-file", required=True, help="the results, one a line in the input's order "
                   "(- : stdout)")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as a first --model")
    engine_args_fn(p, multi_model=True)
    add_arguments(p, ServerConfig, exclude=NETWORK_OPTIONS)
    for cls in (LoopConfig, RouterConfig, ParallelConfig):
        add_arguments(p, cls)
    p.set_defaults(fn=lambda args: cmd_run_batch(args, engine_kwargs_fn, p))
    return p


def cmd_run_batch(args: argparse.Namespace, engine_kwargs_fn: Callable[[argparse.Namespace], dict],
                  parser: argparse.ArgumentParser) -> int:
    from tqdm import tqdm

    from pagedlm.server.cli import apply_config, model_specs, served_app

    if args.config:
        apply_config(args, parser, args.config)
    if args.model_tag:
        args.model = [args.model_tag, *(args.model or [])]
    cfg = ServeConfig.from_args(args, engine_kwargs_fn)
    cfg = replace(cfg, server=replace(cfg.server, api_key=[]))  # in process: no key, whatever $PAGEDLM_API_KEY says
    specs = model_specs(args.model, cfg.server.served_model_name)
    source_path, out_path = args.input_file, args.output_file
    if source_path != "-" and not Path(source_path).is_file():
        raise FileNotFoundError(f"--input-file {source_path}: no such file")
    if "-" not in (source_path, out_path) and Path(out_path).resolve() == Path(source_path).resolve():
        raise ValueError("--output-file must not be the input file")
    total = None
    if source_path != "-":
        with open(source_path, "rb") as f:
            total = sum(1 for line in f if line.strip())
    source = (io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace") if source_path == "-"  # noqa: SIM115
              else open(source_path, encoding="utf-8", errors="replace"))  # bytes that are no UTF-8: U+FFFD
    out = sys.stdout if out_path == "-" else open(out_path, "w", encoding="utf-8")  # noqa: SIM115 - before loading
    try:
        with served_app(cfg, specs) as (app, _), tqdm(total=total, unit="req", desc="run-batch", file=sys.stderr,
                                                       mininterval=1.0) as bar:
            window = 2 * cfg.engine.max_num_seqs * len(specs)
            summary = asyncio.run(run_batch(app, source, out, window=window, max_line_chars=cfg.server.max_body_bytes,
                                            progress=lambda: bar.update()))
    finally:
        if source_path != "-":
            source.close()
        if out is not sys.stdout:
            out.close()
    logger.info("run-batch: %s", summary.describe())
    return 0
