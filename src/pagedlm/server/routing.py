"""The `auto` route: a `Router` over the served engines, fed with their live load.

Decisions run on one worker thread (a learned policy embeds the prompt there, off the event loop, and calls
into the embedding model never overlap). Each engine gets a `LoadTracker` listener for its recent latencies.
"""
from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from pagedlm.engine.async_engine import AsyncLLMEngine, StepRecord
from pagedlm.router import Decision, LoadStats, Router

DEFAULT_ROUTE_NAME = "auto"


class LoadTracker:
    """An engine's `LoadStats`: its latest stats snapshot plus the mean TTFT and inter-token latency of the last
    `window_s` seconds (None when nothing came out lately, so an idle model is not judged by old samples)."""

    def __init__(self, engine: AsyncLLMEngine, window_s: float = 30.0) -> None:
        self.engine, self.window_s = engine, window_s
        self._ttft: deque[tuple[float, float]] = deque(maxlen=256)
        self._itl: deque[tuple[float, float]] = deque(maxlen=1024)
        self._lock = threading.Lock()
        engine.add_listener(self.on_step)

    def on_step(self, rec: StepRecord) -> None:
        if rec.ttft or rec.itl:
            now = time.monotonic()
            with self._lock:
                self._ttft.extend((now, v) for v in rec.ttft)
                self._itl.extend((now, v) for v in rec.itl)

    def _recent(self, samples: deque[tuple[float, float]]) -> float | None:
        since = time.monotonic() - self.window_s
        with self._lock:
            values = [v for t, v in samples if t >= since]
        return sum(values) / len(values) if values else None

    def stats(self) -> LoadStats:
        s = self.engine.stats
        return LoadStats(queue_len=s.num_waiting, running=s.num_running, kv_usage=s.kv_cache_usage,
                         ttft_s=self._recent(self._ttft), tpot_s=self._recent(self._itl),
                         healthy=self.engine.is_running)


class AutoRoute:
    """Requests for model `name` go where `router` decides among `engines` (every router model must be
    served). `route` / `fallback` raise NoCandidateError when no model can take the request."""

    def __init__(self, router: Router, engines: Mapping[str, AsyncLLMEngine], name: str = DEFAULT_ROUTE_NAME) -> None:
        missing = sorted(set(router.models) - set(engines))
        if missing:
            raise ValueError(f"the router names models that are not served: {missing}")
        if name in engines:
            raise ValueError(f"the route name {name!r} is also a model name")
        self.router, self.name = router, name
        self.trackers = {m: LoadTracker(engines[m]) for m in router.models}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedlm-router")

    def load(self) -> dict[str, LoadStats]:
        return {m: t.stats() for m, t in self.trackers.items()}

    async def route(self, prompt: str, max_tokens: int | None) -> Decision:
        return await self._run(self.router.route, prompt, max_tokens, self.load())

    async def fallback(self, failed: Decision, prompt: str, max_tokens: int | None, tried: list[str]) -> Decision:
        return await self._run(self.router.fallback, failed, prompt, max_tokens, self.load(), tried)

    def warm_up(self) -> None:
        """Run one decision now, so the first request does not pay for loading a classifier's embedder."""
        self.router.route("warm-up", 16)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., Decision], *args) -> Decision:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))
