"""The dispatcher: the server's side of the `Router` (router/), which places each request for the auto model's
name (`auto`) on one of the served engines. It feeds the router the engines' live load and asks it for decisions.

Decisions run on one worker thread (a learned policy embeds the prompt there, off the event loop, and calls
into the embedding model never overlap). Each engine gets a `LoadTracker` listener for its recent latencies, and
a listener that settles the budget holds of routed requests with the tokens they used (finished, aborted or
failed: what was computed is paid for).
"""
from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pagedlm.engine.client import EngineClient, StepRecord
from pagedlm.router import BudgetExceededError, Decision, LoadStats, Router

DEFAULT_AUTO_NAME = "auto"
R = TypeVar("R")


class LoadTracker:
    """An engine's `LoadStats`: its latest stats snapshot plus the mean TTFT and inter-token latency of the last
    `window_s` seconds (None when nothing came out lately, so an idle model is not judged by old samples)."""

    def __init__(self, engine: EngineClient, window_s: float = 30.0) -> None:
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

    def recent_means(self) -> tuple[float | None, float | None]:
        """The mean TTFT and inter-token latency (seconds) of the last `window_s` seconds (None: no sample)."""
        return self._recent(self._ttft), self._recent(self._itl)

    def stats(self) -> LoadStats:
        s = self.engine.stats
        ttft, tpot = self.recent_means()
        return LoadStats(queue_len=s.num_waiting, running=s.num_running, kv_usage=s.kv_cache_usage,
                         ttft_s=ttft, tpot_s=tpot, healthy=self.engine.is_running)


@dataclass
class _InFlight:
    decision: Decision
    prompts_left: int
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Dispatcher:
    """Requests for model `name` (the auto model) go where `router` decides among `engines` (every router model
    must be served). `decide` / `fallback` raise NoCandidateError when no model can take the request."""

    def __init__(self, router: Router, engines: Mapping[str, EngineClient], name: str = DEFAULT_AUTO_NAME) -> None:
        missing = sorted(set(router.models) - set(engines))
        if missing:
            raise ValueError(f"the router names models that are not served: {missing}")
        if name in engines:
            raise ValueError(f"{name!r} names both the auto model and a served model")
        self.router, self.name = router, name
        self.trackers = {m: LoadTracker(engines[m]) for m in router.models}
        self.max_model_len = min(engines[m].max_model_len for m in router.models)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedlm-router")
        self._in_flight: dict[str, _InFlight] = {}  # request id (of the engine) -> its routed request
        self._lock = threading.Lock()
        for m in router.models:
            engines[m].add_listener(self._on_step)

    def load(self) -> dict[str, LoadStats]:
        return {m: t.stats() for m, t in self.trackers.items()}

    async def decide(self, prompt: str, max_tokens: int | None, api_key: str | None = None,
                    cost_tokens: tuple[int, int] | None = None) -> Decision:
        return await self._run(functools.partial(self.router.route, api_key=api_key, cost_tokens=cost_tokens),
                               prompt, max_tokens, self.load())

    async def fallback(self, failed: Decision, prompt: str, max_tokens: int | None, tried: list[str],
                       api_key: str | None = None, cost_tokens: tuple[int, int] | None = None) -> Decision:
        return await self._run(self.router.fallback, failed, prompt, max_tokens, self.load(), tried, api_key,
                               cost_tokens)

    async def escalate(self, first: Decision, mean_logprob: float, prompt: str, max_tokens: int | None,
                       api_key: str | None = None,
                       cost_tokens: tuple[int, int] | None = None) -> tuple[Decision | None, str]:
        return await self._run(self.router.escalate, first, mean_logprob, prompt, max_tokens, self.load(), api_key,
                               cost_tokens)

    def track(self, decision: Decision, request_ids: list[str]) -> None:
        """The engine requests `request_ids` carry the request routed by `decision`: settle its budget hold when
        the last of them ends."""
        entry = _InFlight(decision, len(request_ids))
        with self._lock:
            self._in_flight.update((rid, entry) for rid in request_ids)

    def untrack(self, decision: Decision, request_ids: list[str]) -> None:
        """The request never ran on `decision.model` (refused or failed before any output): drop its hold."""
        with self._lock:
            for rid in request_ids:
                self._in_flight.pop(rid, None)
        self.router.release(decision)

    def _on_step(self, rec: StepRecord) -> None:
        if not rec.finished or not self._in_flight:
            return
        done = []
        with self._lock:
            for out in rec.finished:
                entry = self._in_flight.pop(out.request_id, None)
                if entry is None:
                    continue
                entry.prompt_tokens += out.num_prompt_tokens
                entry.completion_tokens += out.num_generation_tokens
                entry.prompts_left -= 1
                if entry.prompts_left == 0:
                    done.append(entry)
        for e in done:
            self.router.settle(e.decision, e.prompt_tokens, e.completion_tokens)

    def warm_up(self) -> None:
        """Run one decision now, so the first request does not pay for loading a classifier's embedder."""
        try:
            self.router.release(self.router.route("warm-up", 16, observe=False))
        except BudgetExceededError:
            pass  # the policy (and its embedder) ran before the budget check

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., R], *args) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))
