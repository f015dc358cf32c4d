"""Run `pagedlm serve` in a subprocess on an ephemeral 127.0.0.1 port, for integration tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


class ServerProcess:
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

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels other than model_name, e.g. `x{finished_reason=abort}`) -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and every KV block is free; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                    and m["vllm:kv_cache_usage_perc"] == 0 and m["pagedlm:kv_blocks_used"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

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
