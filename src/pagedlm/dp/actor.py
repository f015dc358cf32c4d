"""The replica actor's body: `EngineReplica`, an `AsyncLLMEngine` on its share of the cores, answering `add` /
`abort` / `poll`. `add` takes the `EngineRequest` the front end checked; `poll` is a long poll: it returns, for every
open request with something new, its `EngineOutput` deltas since the last poll merged into one (the engine contract
of protocol.py, as in process) or its error as a `WireError`, plus the step records (latencies, finished requests)
for the metrics, the engine's stats, and the prefix-cache changes (KV events: 8-byte prefixes of the chained block
hashes stored or removed since the last poll). One poll per replica, not one call per token.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

from pagedlm.config import EngineConfig, LoopConfig
from pagedlm.dp.prefix_index import short_hash
from pagedlm.dp.wire import ReplicaInfo, ReplicaPoll
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.client import RequestStream, StepRecord
from pagedlm.engine.errors import WireError, as_engine_error
from pagedlm.engine.protocol import EngineOutput, EngineRequest, merge_outputs
from pagedlm.engine.snapshot import EngineSnapshot


class EngineReplica:
    """The actor body (also usable in-process): one `AsyncLLMEngine` on `num_threads` torch threads, optionally
    pinned to `cpus`. Its methods are coroutines: Ray runs them concurrently on the actor's event loop."""

    MAX_EVENTS = 1 << 16  # undrained KV events beyond this: the next poll sends a snapshot instead

    def __init__(self, config: EngineConfig, num_threads: int | None = None, cpus: list[int] | None = None,
                 loop: LoopConfig | None = None) -> None:
        import torch

        from pagedlm.engine.llm_engine import LLMEngine

        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        if num_threads:
            torch.set_num_threads(num_threads)
        engine = LLMEngine(config)
        self.engine = AsyncLLMEngine(engine, loop or LoopConfig.offline())
        self._streams: dict[str, RequestStream] = {}
        self._ready: dict[str, list[EngineOutput] | WireError] = {}
        self._records: list[StepRecord] = []
        self._records_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot_due = True
        self._pool = engine.block_manager.gpu
        self._pool.events = [] if engine.block_manager.enable_prefix_caching else None
        self.engine.add_listener(self._on_step)

    def _on_step(self, rec: StepRecord) -> None:  # engine thread
        if rec.ttft or rec.itl or rec.finished:
            with self._records_lock:
                self._records.append(rec)

    async def info(self) -> ReplicaInfo:
        try:
            import ray
            node = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - not in Ray
            node = "local"
        import torch
        info = self.engine.input_processor.info
        return ReplicaInfo(info, self.engine.stats, os.getpid(), node, torch.get_num_threads())

    async def add(self, request: EngineRequest, age_s: float) -> WireError | None:
        """Queue a request (checked by the front end; its constraint is compiled here, off the engine thread);
        None, or the refusal. `age_s`: time since its arrival."""
        self._bind_loop()
        request.arrival_time = time.monotonic() - max(age_s, 0.0)
        try:
            await asyncio.to_thread(self.engine.input_processor.prepare_params, request.params)
            stream = self.engine.submit(request)
            await stream.accepted()
        except Exception as e:  # noqa: BLE001 - the verdict goes back to the caller
            return as_engine_error(e, request.request_id).to_wire()
        self._streams[request.request_id] = stream
        asyncio.ensure_future(self._forward(stream))
        return None

    async def _forward(self, stream: RequestStream) -> None:
        rid = stream.request_id
        try:
            async for out in stream:
                pending = self._ready.setdefault(rid, [])
                if isinstance(pending, list):
                    pending.append(out)
                self._wake.set()
        except Exception as e:  # noqa: BLE001
            self._ready[rid] = as_engine_error(e, rid).to_wire()
            self._wake.set()
        finally:
            self._streams.pop(rid, None)

    async def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.abort()
            self._ready.pop(rid, None)

    async def fail_all(self, message: str) -> None:
        self.engine.fail_all(message)

    async def poll(self, timeout: float) -> ReplicaPoll:
        """Wait up to `timeout` s for new outputs; return them with the latest stats, records and KV events."""
        self._bind_loop()
        if not self._ready:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        ready, self._ready = self._ready, {}
        outputs = {rid: items if isinstance(items, WireError) else merge_outputs(items) for rid, items in ready.items()}
        with self._records_lock:
            records, self._records = self._records, []
        record = StepRecord(self.engine.stats)
        for r in records:
            record.ttft += r.ttft
            record.itl += r.itl
            record.finished += r.finished
        e = self.engine
        poll = ReplicaPoll(outputs, record, (e.num_rejected, e.num_failed, e.num_stalled), e.is_running)
        self._publish(poll)
        return poll

    def _publish(self, poll: ReplicaPoll) -> None:
        pool = self._pool
        if pool.events is None:
            return
        # the engine thread appends events while we read: swap the list, then read the old one
        events = pool.drain_events()
        if self._snapshot_due or len(events) > self.MAX_EVENTS:
            self._snapshot_due = False
            poll.cache_snapshot = [short_hash(h) for h in list(pool.cached)]
            return
        for stored, h in events:
            (poll.cache_stored if stored else poll.cache_removed).append(short_hash(h))

    async def resync(self) -> None:
        """The next poll sends the whole published cache state (a new client)."""
        self._snapshot_due = True

    async def ping(self) -> int:
        return os.getpid()

    async def snapshot(self, show_text: bool = False) -> EngineSnapshot:
        return await self.engine.snapshot(show_text)

    async def shutdown(self) -> None:
        self.engine.shutdown()

    def _bind_loop(self) -> None:
        if self._wake is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()

