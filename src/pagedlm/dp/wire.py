"""The messages between the front end and a replica actor over Ray (besides the engine contract's
`EngineRequest`, which `add` takes as it is): what a replica is, and what one long poll brings back."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedlm.engine.client import StepRecord
from pagedlm.engine.errors import WireError
from pagedlm.engine.input_processor import EngineInfo
from pagedlm.engine.llm_engine import EngineStats
from pagedlm.engine.protocol import EngineOutput


@dataclass
class ReplicaInfo:
    """A replica's engine facts (its front end's `InputProcessor` is built from them) and where it runs."""

    engine: EngineInfo
    stats: EngineStats
    pid: int
    node: str
    num_threads: int


@dataclass
class ReplicaPoll:
    """What is new on a replica since the last poll. KV events: short hashes (`prefix_index.short_hash`) of the
    prefix-cache blocks stored or removed, or the whole published set."""

    outputs: dict[str, EngineOutput | WireError]  # what is new of each request since the last poll, or its error
    record: StepRecord  # merged step records since the last poll (its stats: the newest)
    counters: tuple[int, int, int]  # rejected, failed, stalled
    running: bool
    cache_snapshot: list[int] | None = None  # the whole published set (first poll, or after a resync)
    cache_stored: list[int] = field(default_factory=list)
    cache_removed: list[int] = field(default_factory=list)
