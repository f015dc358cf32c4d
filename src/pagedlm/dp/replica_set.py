"""Replicas of one model as one engine: `ReplicaSet` places each request on a replica with a placement policy
(prefix affinity, least loaded, round robin; see placement.py), and moves requests away from a lost replica.

Per request the set hashes the prompt's full blocks once (the chained hashes the engines use) and asks
each replica how many leading ones it published as cached; with the replicas' live load (open requests, KV
usage and free blocks as of their last poll, less what was sent since) that is the policy's input.

A replica that refuses (queue full) or is down at placement: the next choice takes the request. A replica lost
with the request on it (died, hung, engine loop stopped): a request that sent nothing to its client yet is
placed again on another replica (`retries` counts them per lost replica); a started stream fails with
EngineDeadError, which the server turns into an error event and `[DONE]`.

A set is watched (launch.py's `RayWatch`): when the local Ray's raylet or GCS process dies, or a joined cluster
stops answering, every replica goes with it and Ray cannot bring them back, so the set says why (`down_reason`,
/health's 503) while Ray is started again (or joined again once it is back) and its replicas with it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from pagedlm.dp.client import RemoteStream, ReplicaClient
from pagedlm.dp.placement import (
    REPLICA_POLICIES,
    LoadStats,
    NoCandidateError,
    Placement,
    ReplicaLoad,
    ReplicaPolicy,
)
from pagedlm.dp.prefix_index import prompt_block_hashes
from pagedlm.engine.client import EngineClient, StepRecord
from pagedlm.engine.errors import EngineDeadError, QueueFullError
from pagedlm.engine.llm_engine import EngineStats
from pagedlm.engine.protocol import EngineRequest
from pagedlm.engine.spec_decode import SpecStats

logger = logging.getLogger(__name__)


@dataclass
class ReplicaRequest:
    """A request as placement sees it: the request, its prompt length and its prompt's block hashes."""

    request: EngineRequest
    prompt_tokens: int
    hashes: list[int]


class Watch(Protocol):
    """The set's place in what watches its Ray (launch.py's `RayWatch`)."""

    def stop(self, timeout: float) -> None: ...


class ReplicaSet(EngineClient):
    """`replicas` of one model behind the engine interface the server uses (`EngineClient`: submit / abort / stats /
    listeners / fail_all / shutdown). policy: a placement policy (default prefix affinity); max_retries: times a
    request is placed again after losing its replica. `ray_down`: why its Ray is down, while a `watch` brings it
    back."""

    def __init__(self, replicas: list[ReplicaClient], policy: ReplicaPolicy | str = "prefix", max_retries: int = 2,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = {c.name: c for c in replicas}
        self.policy = REPLICA_POLICIES[policy]() if isinstance(policy, str) else policy
        self.max_retries = max_retries
        self.retries = {name: 0 for name in self.replicas}  # requests moved away from each lost replica
        self.decisions = {name: 0 for name in self.replicas}  # requests placed on each replica
        first = replicas[0]
        self.input_processor = first.input_processor  # the replicas serve one model: the same facts and checks
        self.max_waiting, self.stall_timeout = first.max_waiting, first.stall_timeout
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._placing = 0
        self._on_shutdown = on_shutdown
        self.ray_down: str | None = None  # why its Ray is down, while it is brought back
        self.watch: Watch | None = None
        self.adopt(replicas)

    def adopt(self, replicas: list[ReplicaClient]) -> None:
        """Serve with `replicas` (at the start, and in place of lost ones after Ray was restarted)."""
        for c in replicas:
            c.on_lost = self._on_lost
            c.add_listener(self._notify)
        self.replicas = {c.name: c for c in replicas}

    # --- the engine interface (listeners run on a replica's pump thread, with its records) -------------
    def retries_of(self, replica: str) -> int:
        return self.retries.get(replica, 0)

    @property
    def num_open_requests(self) -> int:
        return self._placing + sum(c.num_open_requests for c in self.replicas.values())

    @property
    def is_running(self) -> bool:
        return any(c.is_running for c in self.replicas.values())

    @property
    def down_reason(self) -> str | None:
        if self.ray_down is not None:
            return self.ray_down
        return None if self.is_running else "every replica is down (see the log)"

    @property
    def num_rejected(self) -> int:
        return sum(c.num_rejected for c in self.replicas.values())

    @property
    def num_failed(self) -> int:
        return sum(c.num_failed for c in self.replicas.values())

    @property
    def num_stalled(self) -> int:
        return sum(c.num_stalled for c in self.replicas.values())

    @property
    def stats(self) -> EngineStats:
        """The replicas' stats summed (KV usage: used over total blocks)."""
        snaps = [c.stats for c in self.replicas.values()]
        total = sum(s.num_total_blocks for s in snaps)
        free = sum(s.num_free_blocks for s in snaps)
        moe: dict[int, list[int]] = {}
        for s in snaps:
            for layer, counts in s.moe_expert_tokens.items():
                acc = moe.setdefault(layer, [0] * len(counts))
                moe[layer] = [a + b for a, b in zip(acc, counts)]
        return EngineStats(
            num_running=sum(s.num_running for s in snaps), num_waiting=sum(s.num_waiting for s in snaps),
            num_swapped=sum(s.num_swapped for s in snaps), kv_cache_usage=1.0 - free / max(total, 1),
            num_free_blocks=free, num_total_blocks=total, num_preemptions=sum(s.num_preemptions for s in snaps),
            prompt_tokens=sum(s.prompt_tokens for s in snaps),
            generation_tokens=sum(s.generation_tokens for s in snaps),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in snaps),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in snaps), moe_expert_tokens=moe,
            spec_decode=SpecStats.total([s.spec_decode for s in snaps]))

    def submit(self, request: EngineRequest) -> RemoteStream:
        loop = asyncio.get_running_loop()
        stream = RemoteStream(self, request.request_id, loop)
        ids = request.prompt_token_ids
        hashes = (prompt_block_hashes(ids, self.input_processor.info.kv.block_size, request.cache_salt)
                  if self._prefix_caching else [])
        req = ReplicaRequest(request, len(ids), hashes)
        self._placing += 1
        stream.placement = req
        loop.create_task(self._place(stream, req, set(), first=True))
        return stream

    def abort(self, request_id: str) -> None:
        for c in self.replicas.values():
            c.abort(request_id)

    def fail_all(self, message: str) -> None:
        for c in self.replicas.values():
            c.fail_all(message)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.watch is not None:
            self.watch.stop(timeout)  # a restart under way ends first: Ray is not shut down under it
        for c in self.replicas.values():
            c.shutdown(timeout)
        if self._on_shutdown is not None:
            self._on_shutdown()

    # --- placement -----------------------------------------------------------------------------------
    @property
    def _prefix_caching(self) -> bool:
        return self.input_processor.info.prefix_caching

    def load(self, hashes: list[int] | tuple = ()) -> list[LoadStats]:
        """Each replica's LoadStats for a request whose prompt has these block hashes."""
        out = []
        for c in self.replicas.values():
            s, open_ = c.stats, c.num_open_requests
            running = min(s.num_running, open_)
            out.append(LoadStats(queue_len=open_ - running, running=running, kv_usage=s.kv_cache_usage,
                                 healthy=c.is_running, replica=c.name, free_blocks=s.num_free_blocks,
                                 block_size=c.input_processor.info.kv.block_size,
                                 prefix_blocks=c.prefix.prefix_blocks(hashes)))
        return out

    def choose(self, req: ReplicaRequest, tried: set[str]) -> Placement:
        cands = [ReplicaLoad(s.replica, s) for s in self.load(req.hashes) if s.replica not in tried]
        if not cands:
            raise NoCandidateError("no replica left to try")
        return self.policy.choose(req, cands)

    async def _place(self, stream: RemoteStream, req: ReplicaRequest, tried: set[str], first: bool) -> None:
        error: BaseException | None = None
        try:
            while not stream.finished:
                try:
                    decision = self.choose(req, tried)
                except NoCandidateError as e:
                    error = error or EngineDeadError(f"No replica can take the request: {e}")
                    break
                client = self.replicas[decision.replica]
                try:
                    await client.add(stream, req.request)
                except (QueueFullError, EngineDeadError) as e:
                    tried.add(client.name)
                    if isinstance(e, EngineDeadError):
                        self.retries[client.name] += 1
                    error = e
                    continue
                except Exception as e:  # noqa: BLE001 - InvalidRequestError: bad input, the same on every replica
                    error = e
                    break
                self.decisions[client.name] += 1
                client.prefix.expect(req.hashes)
                logger.debug("Request %s -> replica %s: %s", stream.request_id, client.name, decision.reason)
                error = None
                break
        finally:
            if first:
                self._placing -= 1
        if error is None:
            if first:
                stream.accept(None)
        elif first:
            stream.accept(error)
        else:
            stream.put(error)

    def _on_lost(self, stream: RemoteStream, error: BaseException) -> None:  # a pump thread
        try:
            stream.call_soon_threadsafe(self._handle_lost, stream, error, stream.client)
        except RuntimeError:
            pass

    def _handle_lost(self, stream: RemoteStream, error: BaseException, client: ReplicaClient) -> None:
        """On the stream's loop: retry `stream` elsewhere, or fail it, unless it has moved on already."""
        req: ReplicaRequest | None = stream.placement
        if stream.finished or stream.client is not client:
            return
        lost = client.name
        if req is None or not stream.retryable or stream.attempts > self.max_retries:
            stream.put(error)
            return
        self.retries[lost] = self.retries.get(lost, 0) + 1
        logger.warning("Request %s lost replica %s before sending anything; placing it again",
                       stream.request_id, lost)
        stream.restart()
        req = replace(req)
        asyncio.get_running_loop().create_task(self._place(stream, req, {lost}, first=False))
