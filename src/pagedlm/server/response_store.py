"""The Responses API's stored responses (`store: true`), for `previous_response_id` and GET / DELETE
/v1/responses/{id}: in memory, per API key (a key never sees another's), at most `size` per key (the oldest
goes first) and each for at most `ttl` seconds. A restart clears it. Event-loop thread only."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # this turn's conversation (OpenAI chat messages): its input, then its output
    previous: str | None  # the response it continued
    created: float


class ResponseStore:
    def __init__(self, size: int, ttl: float) -> None:
        if size < 0 or ttl <= 0:
            raise ValueError(f"The response store needs size >= 0 and ttl > 0, got {size} and {ttl}.")
        self.size, self.ttl = size, ttl
        self._keys: dict[str, OrderedDict[str, StoredResponse]] = {}

    def put(self, key: str, rid: str, entry: StoredResponse) -> None:
        if not self.size:
            return
        entries = self._live(key)
        entries[rid] = entry
        while len(entries) > self.size:
            entries.popitem(last=False)

    def get(self, key: str, rid: str) -> StoredResponse | None:
        return self._live(key).get(rid)

    def delete(self, key: str, rid: str) -> bool:
        return self._live(key).pop(rid, None) is not None

    def conversation(self, key: str, rid: str) -> list[dict[str, Any]] | str:
        """The messages of `rid`'s whole chain, oldest first, or the id of the first response of it that is gone
        (`rid` itself, or one it continued)."""
        turns, seen = [], set()
        while rid is not None:
            entry = self.get(key, rid)
            if entry is None or rid in seen:
                return rid
            seen.add(rid)
            turns.append(entry.messages)
            rid = entry.previous
        return [m for turn in reversed(turns) for m in turn]

    def _live(self, key: str) -> OrderedDict[str, StoredResponse]:
        entries = self._keys.setdefault(key, OrderedDict())
        cutoff = time.monotonic() - self.ttl
        while entries and next(iter(entries.values())).created < cutoff:
            entries.popitem(last=False)
        return entries
