"""The work a request needs besides the engine's runs on worker threads, one bounded pool per stage: parsing the
body, rendering a chat, tokenizing (with token controls such as bad_words), compiling grammars, and, after the
engine, building an answer's bulk (its prompt's logprobs, once per prompt; logprobs of whole answers). A flood of
one kind (hostile grammars, huge chats, prompt scoring) waits behind its own stage's threads and no other; past a
stage's queue bound its requests get 503 (`server_busy`, Retry-After) instead of piling up."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from pagedlm.server import DEFAULT_STAGE_QUEUE, DEFAULT_STAGE_THREADS
from pagedlm.server.protocol import RETRY_AFTER_S, APIError

T = TypeVar("T")

STAGES = ("parse", "chat", "tokenize", "grammar", "render")


class _Stage:
    def __init__(self, name: str, threads: int, queue: int) -> None:
        self.name, self.threads, self.queue = name, threads, queue
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=f"pagedlm-{name}")
        self.jobs = 0  # submitted and not yet done (running or queued), whether or not anyone still waits
        self.refused = 0
        self.lock = threading.Lock()

    def done(self, _: Future) -> None:
        with self.lock:
            self.jobs -= 1


class StagePools:
    """One thread pool of `threads` per stage (STAGES); at most `queue` jobs of a stage wait beyond its running
    ones. A job keeps its place until it has finished, even if its request was cancelled (its thread is busy)."""

    def __init__(self, threads: int = DEFAULT_STAGE_THREADS, queue: int = DEFAULT_STAGE_QUEUE) -> None:
        if threads < 1 or queue < 0:
            raise ValueError(f"stage threads must be >= 1 and the queue >= 0, got {threads} and {queue}.")
        self._stages = {name: _Stage(name, threads, queue) for name in STAGES}

    async def run(self, stage: str, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the stage's pool; APIError 503 (not a model's failure: no fallback) if the stage
        already holds threads + queue jobs."""
        s = self._stages[stage]
        with s.lock:
            if s.jobs >= s.threads + s.queue:
                s.refused += 1
                busy = True
            else:
                s.jobs += 1
                busy = False
        if busy:
            raise APIError(503, f"The server is busy ({stage}: {s.threads + s.queue} requests at this stage); "
                                   "retry later.", type="server_error", code="server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        future = s.executor.submit(fn, *args)
        future.add_done_callback(s.done)
        return await asyncio.wrap_future(future)

    def load(self) -> dict[str, tuple[int, int, int]]:
        """Per stage: (jobs running or queued, threads, requests refused so far)."""
        return {name: (s.jobs, s.threads, s.refused) for name, s in self._stages.items()}

    def shutdown(self) -> None:
        for s in self._stages.values():
            s.executor.shutdown(wait=False, cancel_futures=True)
