"""Which matmul path a step's rows take, when the step verifies draft tokens (speculative decoding).

A quantized layer runs its own kernel for products of at most `kernel_max_rows` rows and a GEMM over dequantized
weights above (model/plan.py); the two round differently. A verify step has a row per draft token besides the
sequence's own, so by row count alone it could cross to the GEMM where the step without drafts would not, and the
tokens it accepts would then differ from those decoding one at a time gives. Inside `draft_rows(n)` (the engine
sets it around a step's forward pass) a product chooses its path by its rows less the step's `n` draft rows: as the
same step without drafts would.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_DRAFT_ROWS: ContextVar[int] = ContextVar("pagedlm_draft_rows", default=0)


@contextmanager
def draft_rows(n: int) -> Iterator[None]:
    """Products inside choose their path as without the step's `n` draft-token rows."""
    token = _DRAFT_ROWS.set(max(0, n))
    try:
        yield
    finally:
        _DRAFT_ROWS.reset(token)


def path_rows(rows: int) -> int:
    """The row count a product of `rows` rows chooses its path by."""
    return max(1, rows - _DRAFT_ROWS.get()) if rows else 0
