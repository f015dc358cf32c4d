"""Weights in 2 MiB pages. A decode step streams every weight once; from 4 KiB pages each page of the stream costs a
TLB miss, and the hardware prefetchers stop at every page's end. A mapped file is in 2 MiB pages only as far as its
page cache folios are (they are as large as the reads that filled them made them: a repacked-weight file mapped by a
1B model was 37% in 4 KiB pages on a Zen 4). In anonymous memory advised MADV_HUGEPAGE the same weights decoded
1.08-1.19x as fast at 1B-3B (docs/benchmarks.md). So the quantized weights live there: converted into it at a first
start, read into it from the repacked-weight cache at a second (weight_cache.py)."""
from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this OS gives a mapping advised MADV_HUGEPAGE huge pages (Linux, transparent huge pages not
    `never`)."""
    try:
        return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


class HugePageArena:
    """Tensors carved from anonymous mappings advised MADV_HUGEPAGE, `chunk` bytes each (a tensor larger than that
    gets a mapping of its own), each tensor 4 KiB-aligned. Only the pages a tensor's data touches become resident: the
    unused end of a chunk costs address space, not memory. A mapping lives as long as a tensor carved from it."""

    def __init__(self, chunk: int = 64 << 20) -> None:
        self.chunk = chunk
        self.bytes = 0  # carved so far
        self._map: mmap.mmap | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor, as torch.empty(shape, dtype=dtype)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        m, offset = self._carve(nbytes)
        return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)

    def read(self, fd: int, position: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor read from file `fd` at `position` (the kernel copies from the page cache: no page of the file is
        mapped into this process). OSError if the file ends before it."""
        t = self.empty(shape, dtype)
        view = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], position + done)
            if n <= 0:
                raise OSError(f"the file ends {len(view) - done} bytes short of a buffer")
            done += n
        return t

    def _carve(self, nbytes: int) -> tuple[mmap.mmap, int]:
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        if self._map is None or self._used + size > len(self._map):
            self._map = mmap.mmap(-1, max(self.chunk, -(-size // HUGE_PAGE) * HUGE_PAGE),
                                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._map.madvise(mmap.MADV_HUGEPAGE)
            self._used = 0
        offset, self._used = self._used, self._used + size
        self.bytes += nbytes
        return self._map, offset
