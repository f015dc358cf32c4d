"""Servers for integration tests on an ephemeral 127.0.0.1 port: `pagedlm serve` in a subprocess, or an app
served by uvicorn on a thread of the test process (so tests can reach into its engines)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


class _Endpoint:
    url: str | None = None
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", headers={**self.headers(), **kw.pop("headers", {})}, timeout=60, **kw)

    def metrics(self, all_labels: bool = False) -> dict[str, float]:
        """Sample name (with labels other than model_name unless `all_labels`, e.g. `x{finished_reason=abort}`)
        -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if all_labels or k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until no model runs or waits anything and every KV block is free; returns the last
        metrics (of the last model, as `metrics()` gives them)."""
        busy = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "pagedlm:kv_blocks_used")
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics(all_labels=True)
            idle = all(v == 0 for k, v in samples.items() if k.split("{")[0] in busy)
            if idle or time.monotonic() > deadline:
                return self.metrics()
            time.sleep(0.05)


class InProcessServer(_Endpoint):
    """Serves `app` with uvicorn on a daemon thread (with `config`, a uvicorn.Config of it, if given); ready when
    constructed. `stop()` ends it."""

    def __init__(self, app, timeout: float = 30.0, config=None) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(config or uvicorn.Config(app, log_config=None, access_log=False,
                                                              timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@contextmanager
def routed_server(model_dir: Path, router, names: tuple[str, ...] = ("small", "big"),
                  **app_kwargs) -> Iterator[tuple[InProcessServer, dict, Any]]:
    """Tiny engines named `names` (default "small" and "big"; float32, 64 KV blocks, 8 waiting at most), behind
    `router` as the auto model (`model: "auto"`), served in process: yields (server, engines, dispatcher) and shuts
    them all down after."""
    from pagedlm.config import LoopConfig
    from pagedlm.engine.async_engine import AsyncLLMEngine
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.server.api import build_app
    from pagedlm.server.dispatch import Dispatcher

    engines = {name: AsyncLLMEngine(LLMEngine.from_args(str(model_dir), dtype="float32", num_kv_blocks=64),
                                    LoopConfig.offline(max_waiting=8, log_interval=0)) for name in names}
    dispatcher = Dispatcher(router, engines)
    server = InProcessServer(build_app(engines, dispatcher=dispatcher, **app_kwargs))
    try:
        yield server, engines, dispatcher
    finally:
        server.stop()
        dispatcher.shutdown()
        for e in engines.values():
            e.shutdown()


class ServerProcess(_Endpoint):
    """Launches at construction (returns at once); `wait_ready()` blocks until /health answers.
    `stop()` always ends the process (SIGTERM, then SIGKILL) and deletes its log unless
    $PAGEDLM_KEEP_SERVER_LOGS is set."""

    def __init__(self, *serve_args: str, api_key: str | None = None, env: dict[str, str] | None = None) -> None:
        self.api_key = api_key
        fd, log = tempfile.mkstemp(prefix="pagedlm-serve-", suffix=".log")
        self.log_path = Path(log)
        cmd = [sys.executable, "-m", "pagedlm.cli", "serve", "--host", "127.0.0.1", "--port", "0", *serve_args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        os.close(fd)
        self.url: str | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if self.url is None:
                m = re.search(r"Serving .* at (http://127\.0\.0\.1:\d+)", self.log())
                self.url = m.group(1) if m else None
            if self.url is not None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        if not os.environ.get("PAGEDLM_KEEP_SERVER_LOGS"):
            self.log_path.unlink(missing_ok=True)
