"""The repacked-weight cache: the layouts model/quant/ converts a GGUF's blocks into (x16 tiles, int8 tables), kept
on disk so that a second start maps them (mmap) instead of converting again.

One file per model file and CPU, `<directory>/<digest>.bin`, mode 0600 in a 0700 directory owned by the user
(weight_file.py: the layout). A load that converted anything the file did not hold writes a new one once it is
done, on a thread of its own (the engine starts serving meanwhile; the process waits for it at exit), into a
temporary file renamed over the old one. A file is used only if all of this holds, else it is logged, ignored and
rebuilt:
- it is a regular file owned by this user that neither group nor others can write (as the kernel cache's libraries);
- its index is intact (magic, format version, SHA-256 of the index) and its key is this load's: the model file's
  path, size, mtime and a digest of its header and of samples of its data; the CPU's flags; the quantized kernel's
  build key (its sources, compiler and flags: it does the conversions) and a digest of model/quant/'s Python sources;
- its size is the index's, every buffer lies inside it, page-aligned, without overlap, and matches its checksum:
  CRC-32 of the whole buffer up to 256 KiB, else of 16 pages spread over it, first and last included (enough for a
  truncated, stale or partly written file and most damage, without reading GBs at every start).
The buffers a layer takes from the file must have the shapes and dtypes it asks for, so whatever the file holds
cannot make a kernel read outside a buffer. Files whose model file is gone are removed when another is written, and
the files stay within a disk budget (`weight_cache_budget`; least recently used removed first, none written where it
would leave less than 1 GiB of disk free).

With huge pages (huge_pages.py, the default on Linux), the buffers converted at a first start are allocated in a
huge-page arena, and the mapping of the file at a second start is advised MADV_HUGEPAGE and faulted in at once: the
weights run from 2 MiB pages either way.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedlm import cbuild
from pagedlm.cpu import cpu_features
from pagedlm.hub.gguf_file import GGUFFile
from pagedlm.model import huge_pages, weight_file
from pagedlm.model.huge_pages import HugePageArena
from pagedlm.model.weight_file import DTYPES

logger = logging.getLogger(__name__)

Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass
class WeightCacheStats:
    """What one load did with the cache (`CausalLM.weight_cache`)."""

    path: Path
    hits: int = 0  # converted weights mapped from the file
    huge_bytes: int = 0  # bytes of the file mapped in 2 MiB pages
    misses: int = 0  # weights converted at this start
    written: bool = False  # the file was (re)written after the load
    rejected: str | None = None  # why an existing file was not used
    writer: threading.Thread | None = field(default=None, repr=False)  # writing the file

    def wait(self) -> None:
        """Until the file is written (if it is being written)."""
        if self.writer is not None:
            self.writer.join()

    def describe(self) -> str:
        huge = f" ({self.huge_bytes / 2**20:.0f} MiB in 2 MiB pages)" if self.huge_bytes else ""
        if self.hits and not self.misses:
            return f"repacked weights: {self.hits} mapped from {self.path}{huge}"
        s = f"repacked weights: {self.misses} converted"
        if self.hits:
            s += f", {self.hits} mapped{huge}"
        if self.rejected:
            s += f" ({self.path.name} not used: {self.rejected})"
        return s + f", cached in {self.path}" + (" (being written)" if self.writer and not self.written else "")


def cache_file(directory: Path, source: Path) -> Path:
    """The cache file of the model file `source` on this CPU in `directory` (whatever its key: a stale one is
    replaced)."""
    name = json.dumps([str(Path(source).resolve()), sorted(cpu_features().flags)])
    return Path(directory) / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.bin"


class WeightCache:
    """The cache file of one model file: `lookup` gives a converted weight's buffers as views of the mapped file,
    `add` records the ones converted at this start, `save` writes them (on a thread of its own)."""

    def __init__(self, directory: Path, source: Path, key: dict, budget: int | None = None,
                 huge: bool = True) -> None:
        self.key = key
        self.budget = budget
        self.huge = huge  # map the file in 2 MiB pages
        self.stats = WeightCacheStats(cache_file(directory, source))
        self._entries: dict[str, list[list]] = {}  # the file's: entry -> [[dtype, shape, offset, nbytes, crc]]
        self._mapping: mmap.mmap | None = None
        self._new: dict[str, list[torch.Tensor]] = {}  # every entry of this load, mapped or converted, in order
        self._load()

    @classmethod
    def open(cls, directory: Path, source: Path, reader: GGUFFile, budget: int | None = None,
             huge: bool = True) -> WeightCache | None:
        """The cache of `source` (read as `reader`) in `directory`, its files within `budget` bytes (None: half the
        disk space free for them), mapped in 2 MiB pages with `huge`, or None where the directory cannot be used."""
        try:
            return cls(cbuild.private_dir(Path(directory).expanduser()), source, weight_file.cache_key(source, reader),
                       budget, huge)
        except (OSError, RuntimeError) as e:
            logger.warning("Repacked-weight cache off (%s: %s); weights are converted at every start.",
                           type(e).__name__, e)
            return None

    def lookup(self, entry: str, specs: Sequence[Spec]) -> list[torch.Tensor] | None:
        """The buffers of `entry` with `specs` (shape, dtype) mapped from the file, or None (not held, or held with
        other shapes: then converted and the file rewritten)."""
        record = self._entries.get(entry)
        if record is None or [(dtype, tuple(shape)) for dtype, shape, *_ in record] != [
                (str(dtype), tuple(shape)) for shape, dtype in specs]:
            return None
        tensors = [weight_file.view(self._mapping, offset, shape, DTYPES[dtype])
                   for dtype, shape, offset, _, _ in record]
        self._new[entry] = tensors
        self.stats.hits += 1
        return tensors

    def add(self, entry: str, tensors: list[torch.Tensor]) -> None:
        """`entry` was converted into `tensors` at this start."""
        self._new[entry] = tensors
        self.stats.misses += 1

    def close_file(self) -> None:
        """The load is over: no more lookups. The mapping is closed where no buffer is a view of it (none was used):
        the pages its checks touched leave this process. (Views do not pin it: closing it would unmap their
        memory.)"""
        if self._mapping is None:
            return
        if self.stats.hits:  # buffers are views of it
            self.stats.huge_bytes = huge_pages.file_pmd_mapped(self._mapping) if self.huge else 0
        else:
            self._mapping.close()
            self._mapping = None

    def save(self) -> None:
        """If this load converted anything, write the file on a thread of its own (the engine need not wait for
        the disk; the process does at exit): `stats.wait()` waits for it. A failure is logged, never raised."""
        if self.stats.misses:
            self.stats.writer = threading.Thread(target=self._write, args=(dict(self._new),),
                                                 name="pagedlm-weight-cache")
            self.stats.writer.start()

    def _write(self, entries: dict[str, list[torch.Tensor]]) -> None:
        path, t0 = self.stats.path, time.perf_counter()
        tmp = None
        try:
            weight_file.remove_stale_tmp(path)
            weight_file.remove_orphans(path.parent)
            needed = weight_file.file_bytes(entries, self.key)
            if (full := weight_file.make_room(path.parent, path, needed, self.budget)) is not None:
                logger.warning("Repacked weights not cached: %s.", full)
                return
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")  # mode 0600
            try:
                weight_file.write(fd, self.key, entries)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            self.stats.written = True
            logger.info("Repacked weights cached in %s (%.1f GiB, %.1f s).", path, path.stat().st_size / 2**30,
                        time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - on its own thread: whatever fails is said, and the cache skipped
            logger.warning("Could not write the repacked-weight cache %s: %s: %s", path, type(e).__name__, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _load(self) -> None:
        path = self.stats.path
        if not os.path.lexists(path):
            return
        if not cbuild.trusted(path):
            self.stats.rejected = "not a file owned by this user that only this user can write"
        else:
            try:
                self._mapping, self._entries = weight_file.read(path, self.key, self.huge)
                os.utime(path)  # recently used: the last the budget removes
            except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # whatever a damaged file holds
                self.stats.rejected = str(e) or type(e).__name__
        if self.stats.rejected:
            logger.warning("Repacked-weight cache %s is not used (%s); it is rebuilt.", path, self.stats.rejected)


_ACTIVE: ContextVar[tuple[WeightCache | None, HugePageArena | None]] = ContextVar("pagedlm_weight_cache",
                                                                                default=(None, None))


@contextmanager
def active(cache: WeightCache | None, arena: HugePageArena | None = None) -> Iterator[None]:
    """Conversions in this block (`converted`) go through `cache`, which saves what they converted at the end, and
    put their buffers in `arena` (None: torch's allocator)."""
    token = _ACTIVE.set((cache, arena))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        if cache is not None:
            cache.close_file()
    if cache is not None:
        cache.save()
        logger.info("%s", cache.stats.describe())


def converted(source: str | None, layout: str, specs: Sequence[Spec],
              fill: Callable[[list[torch.Tensor]], None]) -> list[torch.Tensor]:
    """The buffers (`specs`: shape, dtype) of the weight `source` (its identity in the file, e.g. RawBlocks.source;
    None: not cacheable) converted into `layout`: mapped from the active cache where it holds them, else allocated
    (in the active arena, if any) and filled by `fill` (and added to the cache)."""
    cache, arena = _ACTIVE.get()
    if source is None:
        cache = None
    entry = f"{layout}|{source}"
    if cache is not None and (hit := cache.lookup(entry, specs)) is not None:
        return hit
    tensors = [arena.empty(tuple(shape), dtype) if arena is not None else torch.empty(shape, dtype=dtype)
               for shape, dtype in specs]
    fill(tensors)
    if cache is not None:
        cache.add(entry, tensors)
    return tensors
