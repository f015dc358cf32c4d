"""How many KV blocks sequences need (for admission and sizing), from block_size and each KV cache group's
sliding window: pure arithmetic over the block manager's allocation rules (block_manager.py)."""
from __future__ import annotations


def max_blocks_needed(sliding_windows: list[int | None], block_size: int, prompt_len: int, total_len: int,
                      width: int = 1, max_chunk: int | None = None) -> int:
    """Most blocks `width` sequences forked after a prompt of `prompt_len` tokens hold at once while they grow
    to `total_len` tokens each, prefilled in chunks of at most `max_chunk` tokens (default: in one chunk). A
    sliding-window group holds at most the window before a chunk, the chunk, and one partly used block."""
    def blocks(n: int) -> int:
        return -(-n // block_size)

    full = blocks(total_len) if width == 1 else blocks(prompt_len) + width * (blocks(total_len - prompt_len) + 1)
    chunk = min(max_chunk or total_len, total_len)
    return sum(full if w is None else min(full, width * (blocks(chunk + w - 1) + 1)) for w in sliding_windows)


def max_tokens_per_seq(sliding_windows: list[int | None], block_size: int, num_blocks: int,
                       max_chunk: int | None = None) -> int:
    """The longest single sequence whose blocks fit in `num_blocks` (at most num_blocks x block_size)."""
    lo, hi = 0, num_blocks * block_size
    while lo < hi:  # the need grows with the length
        mid = (lo + hi + 1) // 2
        if max_blocks_needed(sliding_windows, block_size, mid, mid, 1, max_chunk) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
