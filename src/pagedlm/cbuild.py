"""Compile a plain-C++ kernel source (C ABI, no torch headers) with the system's g++ on first use, cache the
library, and load it with ctypes. `KernelLibrary` is how a kernel module declares its source: it builds, checks and
loads it once, or says (once) why not and what runs instead.

The cache is a per-user directory, `$PAGEDLM_CACHE/kernels/<uid>/`, kept at mode 0700. A library's name holds a
hash of the source (and the local files it #includes), the compiler's path and identity (the first line of
`$CXX --version`), the flags, the CPU and ABI_VERSION. A cached library is loaded only if it is a regular file
owned by the current user that neither group nor others can write; anything else is rebuilt in its place. After
loading, its `pagedlm_abi_version()` must equal ABI_VERSION.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator

from pagedlm import paths
from pagedlm.cpu import cpu_flags, kernel_march

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]
ABI_VERSION = 4  # csrc/pagedlm.h's PAGEDLM_ABI_VERSION

# Status codes of the kernels' entry points (csrc/pagedlm.h).
UNSUPPORTED, BAD_BATCH, BAD_BLOCK, BAD_SLOT = -1, -2, -3, -4
_STATUS = {
    UNSUPPORTED: "unsupported head_dim, dtype or layout",
    BAD_BATCH: "inconsistent batch layout (query_start_loc, seq_lens or a block table narrower than its sequence)",
    BAD_BLOCK: "a block table entry the kernel would read is outside the KV cache",
    BAD_SLOT: "a slot mapping entry is outside the KV cache",
}


def kernel_error(rc: int, what: str) -> Exception:
    """The exception for a kernel's nonzero status: ValueError for a batch it refused (having read nothing out of
    range and written nothing), RuntimeError otherwise."""
    error = ValueError if rc in (BAD_BATCH, BAD_BLOCK, BAD_SLOT) else RuntimeError
    return error(f"{what}: {_STATUS.get(rc, f'failed with code {rc}')}")


def cache_dir() -> Path:
    """This user's kernel cache: `<cache root>/kernels/<uid>`."""
    return paths.cache_dir() / "kernels" / str(os.getuid())


def _private_cache_dir() -> Path:
    """cache_dir(), private to this user (private_dir)."""
    return private_dir(cache_dir())


def private_dir(path: Path) -> Path:
    """`path`, created with mode 0700; an existing one must be a directory (not a link) owned by this user (its mode
    is set back to 0700). OSError where it cannot be created, RuntimeError where it is not this user's own."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory owned by this user")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def trusted(path: Path) -> bool:
    """A regular file (not a link) owned by this user that neither group nor others can write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cpu_key() -> str:
    """Kernels are built with -march=native: key the cache on the CPU's own flags too (not PAGEDLM_ISA's view of
    them: a -march=haswell build is the same library either way)."""
    return platform.machine() + " ".join(sorted(cpu_flags()))


def _source_bytes(source: Path, seen: set[Path] | None = None) -> bytes:
    """The source followed by every local file it #includes ("..." includes, recursively)."""
    seen = set() if seen is None else seen
    source = source.resolve()
    if source in seen:
        return b""
    seen.add(source)
    text = source.read_bytes()
    out = [text]
    for inc in re.findall(rb'^\s*#include\s+"([^"]+)"', text, flags=re.M):
        out.append(_source_bytes(source.parent / inc.decode(), seen))
    return b"".join(out)


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    return cxx


@functools.lru_cache(maxsize=None)
def compiler_identity(cxx: str) -> str:
    """The first line of `cxx --version` (e.g. "g++ (Debian 12.2.0-14) 12.2.0"), asked once per process."""
    res = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0 or not res.stdout.strip():
        raise RuntimeError(f"{cxx} --version failed:\n{res.stderr[-2000:]}")
    return res.stdout.splitlines()[0]


EMULATED_AVX512 = "avx512-emulated"  # a target name for flags(): see emulation_available()


def flags(march: str = "native") -> list[str]:
    """FLAGS, with `-march=<march>` (e.g. "haswell" for an AVX2-only build, "x86-64" for the portable one; "native"
    is PAGEDLM_ISA's level, see cpu.py).
    EMULATED_AVX512 is an AVX2 build whose AVX-512 paths run on SIMDe's portable intrinsics (csrc/simd.h), for tests
    only: at -O1, a third of -O3's compile time (23 s against 72 for attention and the quantized kernels), the same
    bits, and the tests' small products run in seconds either way."""
    if march == EMULATED_AVX512:
        return [*(f.replace("-O3", "-O1") for f in flags("haswell")), "-DPAGEDLM_EMULATE_AVX512", "-Wno-psabi"]
    if march == "native":
        march = kernel_march()  # "haswell" under PAGEDLM_ISA=avx2
    return [f"-march={march}" if f.startswith("-march=") else f for f in FLAGS]


@functools.lru_cache(maxsize=None)
def emulation_available() -> bool:
    """Whether the compiler finds SIMDe's AVX-512 headers (Debian: libsimde-dev), which an EMULATED_AVX512 build
    needs: tests then run the kernels' AVX-512 VNNI / BF16 code on any x86-64 CPU with AVX2."""
    if platform.machine() != "x86_64":
        return False
    try:
        res = subprocess.run([compiler(), "-x", "c++", "-E", "-", "-o", os.devnull],
                             input="#include <simde/x86/avx512.h>\n", capture_output=True, text=True, timeout=60)
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def cache_key(source: Path, cxx: str, march: str = "native") -> str:
    parts = [_source_bytes(source), *(s.encode() for s in (cxx, compiler_identity(cxx), " ".join(flags(march)),
                                                          _cpu_key(), f"abi {ABI_VERSION}"))]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build(source: Path, march: str = "native") -> Path:
    """Compile `source` with flags(march) (unless a trusted build is cached) and return the shared library's path.
    One build per library at a time: a process or thread that finds another building it waits for that build and
    takes its result. Raises on failure."""
    cxx = compiler()
    out = _private_cache_dir() / f"{source.stem}_{cache_key(source, cxx, march)}.so"
    if trusted(out):
        return out
    with _building(out):
        if trusted(out):  # built while this one waited
            return out
        if os.path.lexists(out):
            logger.warning("Rebuilding %s: it is not a file owned by this user that only this user can write.", out)
        for stale in out.parent.glob(f"{out.stem}.build-*"):  # a builder killed mid-compile (none runs now)
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f"{out.stem}.build-") as tmp:
            tmp_out = Path(tmp) / out.name
            res = subprocess.run([cxx, *flags(march), str(source), "-o", str(tmp_out)], capture_output=True,
                                 text=True, timeout=600 if march == EMULATED_AVX512 else 120)
            if res.returncode != 0:
                raise RuntimeError(f"compiling {source.name} failed:\n{res.stderr[-2000:]}")
            os.chmod(tmp_out, 0o755)  # whatever the umask: a group-writable build would count as tampered
            os.replace(tmp_out, out)  # atomic: loaders never see a half-written library
    return out


@contextlib.contextmanager
def _building(out: Path) -> Iterator[None]:
    """An exclusive lock on `<out>.lock` (flock: between processes, and between threads that open it apart)."""
    import fcntl  # POSIX only, as the builds are

    fd = os.open(out.with_name(out.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load(source: Path, march: str = "native") -> ctypes.CDLL:
    """Build (or find) and load `source`'s library; raises if its ABI version is not ABI_VERSION."""
    path = build(source, march)
    lib = ctypes.CDLL(str(path))
    try:
        version_fn = lib.pagedlm_abi_version
    except AttributeError:
        raise RuntimeError(f"{path.name} does not export pagedlm_abi_version()") from None
    version_fn.restype, version_fn.argtypes = ctypes.c_int, []
    version = version_fn()
    if version != ABI_VERSION:
        raise RuntimeError(f"{path.name} has ABI version {version}, this pagedlm needs {ABI_VERSION}")
    return lib


class KernelLibrary:
    """One kernel source, compiled and loaded on first use (`load()`), or None where that cannot be done. The
    gating every kernel shares lives here:

    - PAGEDLM_DISABLE_CPU_KERNEL, or a variable in `disable`, set: None, logged at info, nothing built;
    - not a POSIX system, or no C++ compiler: None with one warning;
    - a failed build, an untrusted cache, an ABI version other than ABI_VERSION, or an entry point `configure`
      cannot declare: None with one warning.

    The warning names the kernel (`name`) and what runs instead (`fallback`). `configure(lib)` declares the
    library's entry points (argtypes, restype). The outcome is kept for the process: one build, one warning.
    `march` other than "native" builds for that target instead (tests of the AVX2 and portable code paths)."""

    def __init__(self, source: Path, name: str, fallback: str, configure: Callable[[ctypes.CDLL], None],
                 disable: tuple[str, ...] = (), march: str = "native") -> None:
        self.source, self.name, self.fallback, self.configure, self.march = source, name, fallback, configure, march
        self.disable = ("PAGEDLM_DISABLE_CPU_KERNEL", *disable)
        self._lock = threading.Lock()
        self._loaded = False
        self._lib: ctypes.CDLL | None = None

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._loaded:
                self._lib, self._loaded = self._try_load(), True
            return self._lib

    def _try_load(self) -> ctypes.CDLL | None:
        for var in self.disable:
            if os.environ.get(var):
                logger.info("%s disabled by %s; %s.", self.name, var, self.fallback)
                return None
        try:
            if os.name != "posix":
                raise RuntimeError(f"kernels are built on POSIX systems only, not {platform.system()}")
            lib = load(self.source, self.march)
            self.configure(lib)
            return lib
        except Exception as e:  # noqa: BLE001 - any failure means: use the fallback
            reason = (str(e).splitlines() or [""])[0]
            logger.warning("%s unavailable (%s: %s); %s.", self.name, type(e).__name__, reason, self.fallback)
            return None
