"""Compile a plain-C++ kernel source (C ABI, no torch headers) with the system's g++ on first use, cached under
`$PAGEDLM_CACHE/kernels/` keyed by the source (and the local files it #includes), compiler, flags and CPU, and
load it with ctypes."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]


def cache_dir() -> Path:
    root = os.environ.get("PAGEDLM_CACHE") or Path.home() / ".cache" / "pagedlm"
    return Path(root) / "kernels"


def _cpu_key() -> str:
    """Kernels are built with -march=native: key the cache on the CPU's flags too."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return platform.machine() + flags


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


def build(source: Path) -> Path:
    """Compile `source` (if not cached) and return the shared library's path. Raises on failure."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    digest = hashlib.sha256(_source_bytes(source) + " ".join([cxx, *FLAGS, _cpu_key()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}_{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        res = subprocess.run([cxx, *FLAGS, str(source), "-o", str(tmp_out)], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never see a half-written library
    return out


def load(source: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(source)))
