"""Which prompt prefixes each replica caches, as the front end sees it: the prompt's chained block hashes (as the
engines' prefix caches compute them, shortened to 8 bytes) and, per replica, the set it published plus the
prompts just sent to it (`PrefixIndex`). Collisions of the short hashes only mislead placement, never results."""
from __future__ import annotations

import time

from pagedlm.kvcache.block_manager import hash_block

HASH_BYTES = 8  # published prefix of each sha256 block hash


def short_hash(h: bytes) -> int:
    return int.from_bytes(h[:HASH_BYTES], "little")


def prompt_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Short chain hashes of the prompt's blocks that the prefix cache can serve (every full block before the
    last token, as `BlockManager.find_cached_prefix` looks them up)."""
    out, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], cache_salt)
        out.append(short_hash(parent))
    return out


class PrefixIndex:
    """One replica's prefix cache as published by its polls (`cached`: short block hashes), plus the prompts sent
    to it since (`expect`), so that a burst of requests sharing a prefix follows the first one."""

    EXPECT_S = 5.0
    MAX_EXPECTED = 1 << 16

    def __init__(self) -> None:
        self.cached: set[int] = set()  # published prefix-cache block hashes
        self.expected: dict[int, float] = {}  # hashes of prompts sent since, until when (insertion-ordered)

    def apply(self, snapshot: list[int] | None, stored: list[int], removed: list[int]) -> None:
        """A poll's KV events: the whole published set (`snapshot`, or None), then what was stored and removed."""
        if snapshot is not None:
            self.cached = set(snapshot)
        self.cached.difference_update(removed)
        self.cached.update(stored)

    def clear(self) -> None:
        """The replica was lost: it caches nothing we know of."""
        self.cached, self.expected = set(), {}

    def prefix_blocks(self, hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its `prompt_block_hashes`) the replica has cached, or will have
        once the requests just sent to it are prefilled (`expect`)."""
        n = 0
        cached, expected = self.cached, self.expected
        for h in hashes:
            if h not in cached and h not in expected:
                break
            n += 1
        return n

    def expect(self, hashes: list[int]) -> None:
        """Count a prompt just sent to the replica as cached until it publishes it (for `EXPECT_S` seconds)."""
        now, expected = time.monotonic(), self.expected
        for h in hashes:
            expected.pop(h, None)
            expected[h] = now + self.EXPECT_S
        while expected:
            h, until = next(iter(expected.items()))
            if until > now and len(expected) <= self.MAX_EXPECTED:
                break
            del expected[h]
