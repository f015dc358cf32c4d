"""The disk tier under the prefix cache: full KV blocks kept as content-addressed run files (disk_format.py)
under `--kv-cache-dir`, within `--kv-disk-budget`, found again after a restart and by every engine sharing the
directory.

Contract:
- The directory is the index. A run file (consecutive blocks of one chain) has one name per block, hard links
  named by the block's chain hash (namespaced by the tier's identity: model, weights, KV dtype and layout), so a
  lookup probes names, finds the run that holds its next block wherever that run started or ended, and reads as
  much of it as its own chain shares; an engine started later, or another engine writing into the same directory,
  finds what is there without any shared state. Files live in `DIR/<namespace>/`, mode 0600, under directories of
  mode 0700 owned by this user.
- Writes run on a writer thread behind a queue bounded in bytes: `submit` never blocks, and drops a run when the
  queue is full; the write budget (write_budget.py) refuses a run in `admit`, before it is copied out, when spent.
  A file is written under a temporary name (`.<name>.<pid>.<random>.tmp`, never read) and linked into place (each
  link atomic, a name already taken is left to the file holding it), so a reader sees a whole file or none. fsync
  policy: none. A killed process cannot leave a torn file under a final name (the links follow the last write); a
  power loss can, and the checksums then reject it.
- Reads (`start_load`) run on a loader thread, one sequential read per run; every record is checked against its
  xxh3-128 digest, the header against its own, the identity and the size against the tier's. A file that fails is
  removed and its blocks are recomputed. A file deleted under a reader is a miss (an open file stays readable).
- The budget is kept by LRU over the whole directory (a file's bytes count once, whatever its names): a hit
  touches its file's mtime, and when the usage (a running total) passes the budget, or a minute after the last
  scan, the directory is scanned again (other engines' files included) and the oldest files go first, every name
  of each.
"""
from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedlm.kvcache.disk_format import CorruptFileError, RunHeader, file_name, namespace_of, record_digest
from pagedlm.kvcache.run_files import RunFile, open_nofollow, private_dir, read_records, scan_runs, write_run
from pagedlm.kvcache.write_budget import WriteBudget

logger = logging.getLogger(__name__)

RESCAN_SECONDS = 60.0  # between scans of the directory while writing (other engines' files count toward the budget)


@dataclass
class DiskTierStats:
    hit_blocks: int = 0  # blocks loaded from disk
    lookups: int = 0  # prefixes that missed in memory and were looked up on disk
    misses: int = 0  # of which nothing was found
    skipped: int = 0  # of which the load was predicted slower than recomputing
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    files_written: int = 0
    writes_dropped: int = 0  # runs not written: the write queue was full, or the write failed
    writes_skipped: int = 0  # blocks not written: the write budget was spent (they stay in memory)
    corrupt_files: int = 0  # files rejected (and removed)
    evicted_files: int = 0
    usage_bytes: int = 0  # the whole directory, as last counted
    num_files: int = 0


@dataclass
class LoadResult:
    """`count` blocks of the chain from the load's `first` block, as records [count, record_bytes]."""

    records: torch.Tensor
    count: int
    nbytes: int
    seconds: float


class DiskTier:
    """Run files of one identity under `root`, within `budget` bytes (the whole directory). Thread-safe."""

    def __init__(self, root: str | Path, budget: int, identity: dict, record_bytes: int,
                 max_pending_bytes: int = 256 << 20, write_share: float = 1.0, clock=time.monotonic) -> None:
        self.root = private_dir(Path(root).expanduser())
        self.identity = identity
        self.namespace = namespace_of(identity)
        self.dir = private_dir(self.root / self.namespace[:32])
        self.budget = budget
        self.record_bytes = record_bytes
        self.max_pending_bytes = max(max_pending_bytes, record_bytes)
        self.stats = DiskTierStats()
        self.write_budget = WriteBudget(write_share, clock=clock)
        self.clock = clock
        self.known: set[bytes] = set()  # chain hashes this tier wrote, is writing, or read
        self._lock = threading.Lock()
        self._files: OrderedDict[int, RunFile] = OrderedDict()  # LRU first, by inode
        self._blocks: dict[int, list[bytes]] = {}  # chain hashes of the files this tier wrote or read, by inode
        self._pending_bytes = 0
        self._queued: dict[bytes, int] = {}  # chain hash -> runs queued that hold it
        self._last_scan = 0.0
        self._scan()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-loader")

    def describe(self) -> str:
        mine = sum(1 for f in self._files.values() if f.paths and next(iter(f.paths)).parent == self.dir)
        return (f"KV disk tier: {self.root} ({self.stats.num_files} files, {self.stats.usage_bytes / 2**30:.2f} of "
                f"{self.budget / 2**30:.2f} GiB; {mine} files for this model and KV layout, namespace "
                f"{self.namespace[:12]})")

    def path(self, chain_hash: bytes) -> Path:
        return self.dir / file_name(self.namespace, chain_hash)

    # --- reads -------------------------------------------------------------------------------------------
    def probe(self, chain: list[bytes], first: int) -> int:
        """Blocks from `first` on whose names are on disk (consecutive; the files are checked when read)."""
        j = first
        while j < len(chain) and self.path(chain[j]).exists():
            j += 1
        return j - first

    def start_load(self, chain: list[bytes], tokens: list[list[int]], first: int, limit: int) -> Future:
        """Read (on the loader thread) at most `limit` blocks of the chain from block `first` on: a Future of
        a LoadResult holding the verified prefix of them. `tokens[i]`: the token ids of block i."""
        return self._loader.submit(self.load, chain, tokens, first, limit)

    def load(self, chain: list[bytes], tokens: list[list[int]], first: int, limit: int) -> LoadResult:
        t0 = time.perf_counter()
        end = min(len(chain), first + limit)
        out = torch.empty((max(end - first, 0), self.record_bytes), dtype=torch.uint8)
        view = out.numpy()
        p = first
        while p < end:
            path = self.path(chain[p])
            try:
                with open(path, "rb", buffering=0, opener=open_nofollow) as f:
                    ino, hdr = self._header(f)
                    off = p - hdr.start
                    m = 0  # records from `off` on that belong to this chain
                    while (p + m < end and 0 <= off + m < hdr.count and hdr.hashes[off + m] == chain[p + m]
                           and hdr.tokens[off + m] == tokens[p + m]):
                        m += 1
                    if m == 0:
                        raise CorruptFileError("named for a block it does not hold")
                    good = read_records(f, hdr, off, view[p - first:p - first + m])
            except FileNotFoundError:
                break
            except (CorruptFileError, OSError) as e:
                self._reject(path, e)
                break
            if good < m:
                self._reject(path, CorruptFileError("record checksum mismatch"))
                p += good
                break
            self._touch(path, ino, hdr.hashes)
            p += m
        n = p - first
        seconds = time.perf_counter() - t0
        with self._lock:
            self.stats.hit_blocks += n
            self.stats.bytes_read += n * self.record_bytes
            self.stats.load_seconds += seconds
            self.known.update(chain[first:p])
        return LoadResult(out[:n], n, n * self.record_bytes, seconds)

    def _header(self, f) -> tuple[int, RunHeader]:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise CorruptFileError("not a regular file of this user")
        hdr = RunHeader.decode(f.read, st.st_size)
        if hdr.namespace != self.namespace or hdr.identity != self.identity or hdr.record_bytes != self.record_bytes:
            raise CorruptFileError("written for another model, KV dtype or layout")
        return st.st_ino, hdr

    def _reject(self, path: Path, error: Exception) -> None:
        logger.warning("KV disk tier: %s is unusable (%s); removed, its blocks are recomputed.", path.name, error)
        with self._lock:
            self.stats.corrupt_files += 1
        try:
            ino = os.lstat(path).st_ino
        except OSError:
            return
        names = {path}  # every name of the file (the scan may not have seen them all)
        for entry in os.scandir(self.dir):
            try:
                if entry.inode() == ino:
                    names.add(Path(entry.path))
            except OSError:
                pass
        with self._lock:
            self._files.setdefault(ino, RunFile(0, set())).paths.update(names)
        self._remove(ino)

    def _touch(self, path: Path, ino: int, hashes: list[bytes]) -> None:
        try:
            os.utime(path)
        except OSError:
            pass
        with self._lock:
            if ino in self._files:
                self._files.move_to_end(ino)
            self._blocks[ino] = hashes

    # --- writes ------------------------------------------------------------------------------------------
    def admit(self, num_blocks: int) -> float | None:
        """Before copying a run of `num_blocks` out: its charge to the write budget, or None (skipped: the
        budget is spent)."""
        charged = self.write_budget.take(num_blocks * self.record_bytes)
        if charged is None:
            with self._lock:
                self.stats.writes_skipped += num_blocks
        return charged

    def submit(self, start: int, hashes: list[bytes], tokens: list[list[int]], records: torch.Tensor,
               charged: float = 0.0, copy_seconds: float = 0.0) -> bool:
        """Queue a run of full blocks (chain positions start.., records [n, record_bytes] uint8, owned by the
        tier from now on) for writing; False (dropped) when the queue holds max_pending_bytes already.
        `charged`: what `admit` charged for it; `copy_seconds`: what copying it out cost."""
        nbytes = records.numel()
        with self._lock:
            if full := self._pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.writes_dropped += 1
            else:
                self._pending_bytes += nbytes
                self.known.update(hashes)
                for h in hashes:
                    self._queued[h] = self._queued.get(h, 0) + 1
        if full:
            self.write_budget.settle(nbytes, charged, copy_seconds)
            return False
        self._queue.put((start, hashes, tokens, records, charged, copy_seconds))
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the queued writes are on disk (True) or `timeout` passes."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._loader.shutdown(wait=True, cancel_futures=True)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            start, hashes, tokens, records, charged, copy_seconds = item
            t0 = time.thread_time()
            try:
                self._write(start, hashes, tokens, records)
            except Exception as e:  # the disk full, gone, ...: the engine goes on without this run
                logger.warning("KV disk tier: a write failed (%s); the run is not kept.", e)
                with self._lock:
                    self.stats.writes_dropped += 1
                    self.known.difference_update(hashes)
            finally:
                self.write_budget.settle(records.numel(), charged, copy_seconds + time.thread_time() - t0)
                with self._lock:
                    self._pending_bytes -= records.numel()
                    for h in hashes:
                        if (left := self._queued.pop(h) - 1) > 0:
                            self._queued[h] = left

    def _write(self, start: int, hashes: list[bytes], tokens: list[list[int]], records: torch.Tensor) -> None:
        arr = records.numpy()
        hdr = RunHeader(self.namespace, self.identity, start, self.record_bytes, hashes, tokens,
                        [record_digest(arr[i].data) for i in range(len(hashes))])
        size, ino, linked = write_run(self.dir, [self.path(h) for h in hashes], hdr.encode(), arr.data)
        if not linked:
            return
        with self._lock:
            self.stats.files_written += 1
            self.stats.bytes_written += size
            self._files[ino] = RunFile(size, linked)
            self._blocks[ino] = hashes
            self.stats.usage_bytes += size
            self.stats.num_files = len(self._files)
            over = self.stats.usage_bytes > self.budget or self.clock() - self._last_scan >= RESCAN_SECONDS
        if over:
            self._scan()
            self._evict()

    # --- the directory -----------------------------------------------------------------------------------
    def _scan(self) -> None:
        files = scan_runs(self.root)
        with self._lock:
            self._files = files
            # forget what other engines removed: `known` stays bounded by what is on disk or queued
            self._blocks = {ino: hashes for ino, hashes in self._blocks.items() if ino in files}
            on_disk = {h for hashes in self._blocks.values() for h in hashes}
            self.known = {h for h in self.known if h in on_disk or h in self._queued}
            self.stats.usage_bytes = sum(f.size for f in files.values())
            self.stats.num_files = len(self._files)
            self._last_scan = self.clock()

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.stats.usage_bytes <= self.budget or not self._files:
                    return
                ino = next(iter(self._files))
            self._remove(ino)
            with self._lock:
                self.stats.evicted_files += 1

    def _remove(self, ino: int) -> None:
        with self._lock:
            entry = self._files.pop(ino, None)
            self.known.difference_update(self._blocks.pop(ino, ()))
            if entry is not None:
                self.stats.usage_bytes -= entry.size
            self.stats.num_files = len(self._files)
        for path in entry.paths if entry is not None else ():
            path.unlink(missing_ok=True)
