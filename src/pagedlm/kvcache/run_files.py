"""The disk tier's run files on disk (their bytes: disk_format.py): the private directories they live in, writing
one under a temporary name and linking it into place under its blocks' names, reading its records back, and
scanning a directory for them (disk_tier.py keeps the index, the budget and the threads)."""
from __future__ import annotations

import os
import secrets
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pagedlm.kvcache.disk_format import SUFFIX, RunHeader, record_digest

STALE_TMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died


def private_dir(path: Path) -> Path:
    """`path`, created with mode 0700; an existing one must be a directory (not a link) owned by this user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise ValueError(f"KV cache directory {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError(f"KV cache directory {path} is not a directory owned by this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


@dataclass
class RunFile:
    """A run file: its size and its names (hard links), one per block."""

    size: int
    paths: set[Path]


def write_run(directory: Path, names: list[Path], header: bytes, data: memoryview) -> tuple[int, int, set[Path]]:
    """Write a run file (`header`, then the records `data`) under a temporary name in `directory`, link it as each of
    `names` not taken yet (a name already taken is left to the run holding that block) and drop the temporary name:
    (its size, its inode, the names linked)."""
    tmp = directory / f".{names[-1].stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    linked = set()
    try:
        with open(fd, "wb") as f:
            f.write(header)
            f.write(data)
        st = os.stat(tmp)
        for name in names:
            try:
                os.link(tmp, name)
                linked.add(name)
            except FileExistsError:  # that block is on disk already, in another run
                pass
    finally:
        tmp.unlink(missing_ok=True)
    return st.st_size, st.st_ino, linked


def scan_runs(root: Path) -> OrderedDict[int, RunFile]:
    """Every run file under `root` by inode, least recently used (mtime) first; dead writers' temporary files
    are removed on the way."""
    found = []
    now = time.time()
    for sub in root.iterdir():
        if not sub.is_dir() or sub.is_symlink():
            continue
        for entry in os.scandir(sub):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                found.append((st.st_mtime, st.st_ino, Path(entry.path), st.st_size))
            elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_SECONDS:
                Path(entry.path).unlink(missing_ok=True)
    found.sort(key=lambda x: x[0])
    files: OrderedDict[int, RunFile] = OrderedDict()
    for _, ino, path, size in found:
        files.setdefault(ino, RunFile(size, set())).paths.add(path)
    return files


def read_records(f, hdr: RunHeader, off: int, out) -> int:
    """Read records off.. of the run into `out` ([m, record_bytes] uint8) in one sequential read; how many of
    them, from the first, match their digests."""
    f.seek(hdr.data_offset + off * hdr.record_bytes)
    dst = memoryview(out).cast("B")
    got = 0
    while got < len(dst) and (n := f.readinto(dst[got:])):
        got += n
    good = 0
    while (good < len(out) and got >= (good + 1) * hdr.record_bytes
           and record_digest(out[good].data) == hdr.digests[off + good]):
        good += 1
    return good


def open_nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)
