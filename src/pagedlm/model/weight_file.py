"""The repacked-weight cache's files (model/weight_cache.py): their key, their directory, their layout and checks.

A file is the converted weights' buffers, each at a page boundary, then the index (JSON: format version, key, data
length, and per entry the dtype, shape, offset, length and checksum of each buffer), then a trailer: MAGIC, the
index's length and its SHA-256. It is written in 2 MiB pieces at 2 MiB boundaries, so the page cache holds it in 2 MiB
folios, and a mapping of it that is advised MADV_HUGEPAGE reads whatever is not cached in 2 MiB folios too: the
weights mapped from it then sit in 2 MiB pages (huge_pages.py).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedlm import cbuild
from pagedlm.cpu import cpu_features
from pagedlm.hub.gguf_file import GGUFFile
from pagedlm.model import huge_pages

FORMAT_VERSION = 2  # 2: written in 2 MiB pieces
MAGIC = b"PGLMWTC1"
TRAILER = struct.Struct("<8sQ32s")  # at the end of the file: magic, index length, SHA-256 of the index
PAGE = mmap.PAGESIZE
SAMPLES = 16  # pages checked per tensor over WHOLE bytes
WHOLE = 256 * 1024
DTYPES = {str(d): d for d in (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int32)}
MIN_FREE = 2**30  # a cache file is not written where it would leave less disk space free
STALE_TMP_S = 24 * 3600  # a temporary file this old is a crashed writer's: removed


def cache_key(source: Path, reader: GGUFFile) -> dict:
    """Everything a cache file must have been built from to be used for `source` here."""
    st = source.stat()
    return {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample": _file_digest(reader), "cpu": sorted(cpu_features().flags), "kernel": _kernel_key(),
            "layouts": _layout_digest(), "format": FORMAT_VERSION, "byteorder": sys.byteorder}


def _file_digest(reader: GGUFFile) -> str:
    """SHA-256 of the file's header (metadata and tensor table) and of SAMPLES pages of its data."""
    buf = reader.mapping
    if buf is None:
        return ""
    start = min((t.offset for t in reader.tensors), default=len(buf))
    h = hashlib.sha256(buf[:start])
    span = max(len(buf) - start - PAGE, 0)
    for i in range(SAMPLES):
        at = start + span * i // (SAMPLES - 1)
        h.update(buf[at:at + PAGE])
    return h.hexdigest()


def _kernel_key() -> str:
    from pagedlm.model.quant import SOURCE

    try:
        return cbuild.cache_key(SOURCE, cbuild.compiler())
    except (OSError, RuntimeError):
        return ""


def _layout_digest() -> str:
    h = hashlib.sha256()
    for f in sorted((Path(__file__).parent / "quant").glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def remove_stale_tmp(path: Path) -> None:
    for tmp in path.parent.glob(f"{path.name}.*.tmp"):
        try:
            if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass


def remove_orphans(directory: Path) -> None:
    """Remove the cache files whose model file is gone (a deleted download, a test's temporary model)."""
    for f in directory.glob("*.bin"):
        try:
            if not Path(_index(f)[0]["key"]["source"]).exists():
                f.unlink()
        except (OSError, ValueError, TypeError, KeyError):
            pass


def file_bytes(entries: dict[str, list[torch.Tensor]], key: dict) -> int:
    """About the size of the cache file `write` makes of `entries` (its index estimated generously)."""
    data = sum(pages(t.numel() * t.element_size()) for tensors in entries.values() for t in tensors)
    return data + len(json.dumps(key)) + 256 * sum(len(tensors) + 1 for tensors in entries.values()) + PAGE


def make_room(directory: Path, keep: Path, needed: int, budget: int | None) -> str | None:
    """Remove the least recently used cache files in `directory` (by mtime: a start that maps a file touches it)
    other than `keep` until one of `needed` bytes fits: the files within `budget` (None: half of the disk space
    free for them) and at least MIN_FREE bytes left free on the disk. None if it fits, else why not."""
    others = []
    for f in directory.glob("*.bin"):
        try:
            if f != keep:
                st = f.stat()
                others.append((st.st_mtime, st.st_size, f))
        except OSError:
            pass
    others.sort()
    free = shutil.disk_usage(directory).free
    held = sum(size for _, size, _ in others)
    limit = budget if budget is not None else (free + held) // 2
    if needed > limit or needed > free + held - MIN_FREE:
        return f"{needed / 2**30:.1f} GiB do not fit the cache's budget ({limit / 2**30:.1f} GiB) and the free disk"
    while others and (held + needed > limit or free < needed + MIN_FREE):
        _, size, f = others.pop(0)
        try:
            f.unlink()
        except OSError:
            continue
        held -= size
        free += size
    return None


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _checked_spans(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """The (start, length) spans of bytes offset .. offset + nbytes that its checksum covers: all of them up to WHOLE,
    else SAMPLES pages."""
    if nbytes <= WHOLE:
        return [(offset, nbytes)]
    return [(offset + (nbytes - PAGE) * i // (SAMPLES - 1), PAGE) for i in range(SAMPLES)]


def checksum(buf, offset: int, nbytes: int) -> int:
    """CRC-32 of bytes offset .. offset + nbytes of `buf`, those of _checked_spans."""
    view, crc = memoryview(buf), 0
    for at, n in _checked_spans(offset, nbytes):
        crc = zlib.crc32(view[at:at + n], crc)
    return crc


def _index(path: Path) -> tuple[dict, int]:
    """A cache file's index (its trailer and SHA-256 checked) and where it starts; ValueError if damaged."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < TRAILER.size:
            raise ValueError("truncated")
        f.seek(size - TRAILER.size)
        magic, length, digest = TRAILER.unpack(f.read(TRAILER.size))
        if magic != MAGIC or length > size - TRAILER.size:
            raise ValueError("not a repacked-weight cache file, or truncated")
        f.seek(size - TRAILER.size - length)
        index = f.read(length)
    if hashlib.sha256(index).digest() != digest:
        raise ValueError("index checksum mismatch")
    return json.loads(index), size - TRAILER.size - length


def read(path: Path, key: dict, huge: bool = True) -> tuple[mmap.mmap, dict[str, list[list]]]:
    """The mapped file, read in (in 2 MiB pages with `huge`, where the OS has them), and its entries, once every check
    of the module docstring passed (else ValueError)."""
    head, index_start = _index(path)
    if head.get("format") != FORMAT_VERSION or head.get("key") != key:
        old = head.get("key") if isinstance(head.get("key"), dict) else {}
        changed = ", ".join(sorted(k for k in key if old.get(k) != key[k])) or "format"
        raise ValueError(f"stale: built for another {changed}")
    end = head["data_bytes"]
    if end != index_start or end % PAGE:
        raise ValueError(f"the index says {end} bytes of buffers, the file holds {index_start}")
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: the file is never written through
    try:
        huge_pages.populate(mapping, huge)
        return mapping, _checked_entries(head, mapping, end)
    except BaseException:
        mapping.close()
        raise


def _checked_entries(head: dict, mapping: mmap.mmap, end: int) -> dict[str, list[list]]:
    entries: dict[str, list[list]] = head["entries"]
    spans = []
    for entry, record in entries.items():
        for dtype, shape, offset, nbytes, crc in record:
            n = numel(d if isinstance(d, int) and d >= 0 else -(1 << 62) for d in shape)
            if (dtype not in DTYPES or n < 0 or n * DTYPES[dtype].itemsize != nbytes
                    or not isinstance(offset, int) or offset < 0 or offset % PAGE or offset + nbytes > end):
                raise ValueError(f"entry {entry!r} does not fit the file")
            if nbytes and checksum(mapping, offset, nbytes) != crc:
                raise ValueError(f"checksum mismatch in {entry!r}")
            spans.append((offset, offset + nbytes))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError("overlapping entries")
    return entries


def view(mapping: mmap.mmap, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Bytes offset .. of `mapping` as a tensor of `shape` and `dtype` (it keeps the mapping alive)."""
    n = numel(shape)
    if n == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(mapping, dtype=dtype, count=n, offset=offset).view(tuple(shape))


def write(fd: int, key: dict, entries: dict[str, list[torch.Tensor]]) -> None:
    """A cache file into `fd`: each entry's buffers at page boundaries, then the index and the trailer."""
    out = _ChunkedWriter(fd)
    index: dict[str, list[list]] = {}
    for entry, tensors in entries.items():
        index[entry] = []
        for t in tensors:
            data = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            index[entry].append([str(t.dtype), list(t.shape), out.pos, data.nbytes, checksum(data, 0, data.nbytes)])
            out.put(data)
            out.put(memoryview(bytes(pages(data.nbytes) - data.nbytes)))
    head = json.dumps({"format": FORMAT_VERSION, "key": key, "data_bytes": out.pos, "entries": index}).encode()
    out.put(memoryview(head + TRAILER.pack(MAGIC, len(head), hashlib.sha256(head).digest())))
    out.flush()


class _ChunkedWriter:
    """Writes a stream to a file in pieces of CHUNK bytes at CHUNK boundaries (the last one shorter): the page cache
    makes a folio of each piece as large as the piece (a buffer written from a 4 KiB boundary left the start of its
    2 MiB in small folios). A piece is written from the buffers it spans (pwritev: no copy, the GIL released)."""

    CHUNK = huge_pages.HUGE_PAGE
    MAX_PARTS = 512  # buffers per piece before they are joined (the OS takes at most 1,024 per call)

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0  # bytes put so far
        self._parts: list[memoryview] = []  # the current piece, not yet written
        self._held = 0  # its bytes

    def put(self, data: memoryview) -> None:
        while data.nbytes:
            if not self._held and data.nbytes >= self.CHUNK:  # whole pieces straight from `data`
                n = data.nbytes - data.nbytes % self.CHUNK
                self._write(self.pos, [data[:n]])
            else:
                n = min(self.CHUNK - self._held, data.nbytes)
                self._parts.append(data[:n])
                self._held += n
                if len(self._parts) > self.MAX_PARTS:  # many small buffers: one copy of them
                    self._parts = [memoryview(b"".join(self._parts))]
            self.pos += n
            data = data[n:]
            if self._held == self.CHUNK:
                self.flush()

    def flush(self) -> None:
        if self._held:
            self._write(self.pos - self._held, self._parts)
            self._parts, self._held = [], 0

    def _write(self, at: int, parts: list[memoryview]) -> None:
        while parts:
            n = os.pwritev(self.fd, parts, at)
            if n <= 0:
                raise OSError(f"short write to the cache file at {at}")
            at += n
            while parts and n >= parts[0].nbytes:
                n -= parts[0].nbytes
                parts = parts[1:]
            if parts and n:
                parts = [parts[0][n:], *parts[1:]]
