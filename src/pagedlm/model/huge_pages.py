"""Weights in 2 MiB pages. A decode step streams every weight once; from 4 KiB pages each page of the stream costs a
TLB miss, and the hardware prefetchers stop at every page's end: from 2 MiB pages the same weights decoded 1.08-1.19x
as fast at 1B-3B on a Zen 4 (docs/benchmarks.md). So weights converted at a first start are put in anonymous memory
advised MADV_HUGEPAGE (`HugePageArena`), and the repacked-weight cache a second start maps is held in 2 MiB pages
too (`populate`): a mapped file is in 2 MiB pages as far as its page cache folios are, and those are as large as the
writes or faults that made them (weight_file.py writes the cache in 2 MiB pieces; a fault in a mapping advised
MADV_HUGEPAGE reads 2 MiB folios). Mapping rather than copying takes no fresh memory, which a VM's host can be slow
to give: a second start of a 1B model took 0.6-0.8 s mapped, 0.7-1.5 s read into an arena, decode the same.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


def available() -> bool:
    """Whether this OS gives a mapping advised MADV_HUGEPAGE huge pages (Linux, transparent huge pages not
    `never`)."""
    try:
        return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def populate(mapping: mmap.mmap, huge: bool = True) -> None:
    """Fault a file's `mapping` in now (page tables filled: no fault while serving), with `huge` (where the OS has
    huge pages) advised MADV_HUGEPAGE first: what is not in the page cache is then read into 2 MiB folios, and what
    is in 2 MiB folios mapped in 2 MiB pages."""
    if huge and available():
        mapping.madvise(mmap.MADV_HUGEPAGE)
    if sys.platform.startswith("linux"):
        try:
            mapping.madvise(MADV_POPULATE_READ)
            return
        except OSError:  # before Linux 5.14
            pass
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_WILLNEED)


def file_pmd_mapped(mapping: mmap.mmap) -> int:
    """How many bytes of a file's `mapping` this process maps in 2 MiB pages (0 where the OS does not say)."""
    try:
        anchor = ctypes.c_char.from_buffer(mapping)
        start = ctypes.addressof(anchor)
        del anchor
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    inside = int(head.split("-")[0], 16) == start
                elif inside and head == "FilePmdMapped:":
                    return int(line.split()[1]) * 1024
    except (OSError, TypeError, ValueError):
        pass
    return 0


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
