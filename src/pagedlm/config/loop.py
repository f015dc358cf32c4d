"""How an engine loop serves its requests (`LoopConfig`): the waiting-queue bound, the stall timeout of unread
outputs, the throughput log. One object for the in-process loop, each replica's, and the server's flags."""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.config.flags import option

LIMITS = "limits and security (see docs/serving.md, *Limits and security*)"  # the flags' help group


@dataclass(frozen=True)
class LoopConfig:
    """An engine loop's serving settings, each a `pagedlm serve` flag of the same name."""

    max_waiting: int = option(512, "requests allowed to wait for a slot; beyond it requests get 503 + Retry-After")
    log_interval: float = option(10.0, "seconds between throughput lines (0: off)")
    stream_stall_timeout: float = option(60.0, "abort a request whose output nobody read for this many seconds, "
                                         "freeing its KV blocks (0: never)", group=LIMITS)

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}.")
        if self.stream_stall_timeout < 0:
            raise ValueError(f"stream_stall_timeout must be >= 0, got {self.stream_stall_timeout}.")

    @classmethod
    def offline(cls, **overrides) -> LoopConfig:
        """A loop driven from Python (`LLM`, tests): no stall timeout, as a caller may hold a stream unread."""
        return cls(**{"stream_stall_timeout": 0.0, **overrides})
