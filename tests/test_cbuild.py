"""The kernel cache (cbuild.py): a private per-user directory, only trusted libraries loaded, the compiler's
identity, the included files and the ABI version in the key, the ABI version checked after loading; KernelLibrary's
gating (disable variables, no compiler, a broken source: None and one warning); the constants the C++ sources
share with Python."""
from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedlm import cbuild

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")

IS_ROOT = hasattr(os, "getuid") and os.getuid() == 0


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CXX", raising=False)
    return tmp_path / "cache" / "kernels" / str(os.getuid())


def tiny_library(source: Path, configured: list | None = None, disable: tuple[str, ...] = ()) -> cbuild.KernelLibrary:
    """A KernelLibrary for `source` whose configure declares marker() (and records the library in `configured`)."""
    def configure(lib: ctypes.CDLL) -> None:
        lib.marker.restype = ctypes.c_int
        if configured is not None:
            configured.append(lib)

    return cbuild.KernelLibrary(source, "Tiny kernel", "using torch", configure, disable=disable)


def tiny_source(tmp_path: Path, marker: int, abi: int | None = cbuild.ABI_VERSION, name: str = "tiny") -> Path:
    """A kernel source exporting marker() (which build got loaded) and, unless abi is None, its ABI version."""
    src = tmp_path / f"{name}_{marker}" / f"{name}.cpp"
    src.parent.mkdir(parents=True, exist_ok=True)
    abi_fn = "" if abi is None else f"int pagedlm_abi_version() {{ return {abi}; }}"
    src.write_text(f'extern "C" {{\nint marker() {{ return {marker}; }}\n{abi_fn}\n}}\n')
    return src


def test_cache_dir_is_private_and_libraries_not_writable_by_others(tmp_path, cache):
    cache.mkdir(parents=True, mode=0o777)
    os.chmod(cache, 0o777)
    out = cbuild.build(tiny_source(tmp_path, 1))
    assert out.parent == cache
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    st = os.stat(out)
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022


def test_cache_dir_owned_by_someone_else_is_refused(tmp_path, cache, caplog):
    if not IS_ROOT:
        pytest.skip("needs root to create a directory owned by another user")
    cache.mkdir(parents=True)
    os.chown(cache, 12345, 12345)
    with pytest.raises(RuntimeError, match="not a directory owned by this user"):
        cbuild.build(tiny_source(tmp_path, 1))
    with caplog.at_level(logging.WARNING, logger="pagedlm.cbuild"):
        assert tiny_library(tiny_source(tmp_path, 2)).load() is None
    assert "Tiny kernel unavailable" in caplog.text and "using torch" in caplog.text


@pytest.mark.parametrize("tamper", ["group_writable", "world_writable", "symlink", "other_owner"])
def test_tampered_cached_library_is_rebuilt_not_loaded(tmp_path, cache, tamper, caplog):
    """The cached file is swapped for another library (marker 666) and left untrusted: the loader must rebuild
    the real one (marker 1) in its place rather than load it."""
    if tamper == "other_owner" and not IS_ROOT:
        pytest.skip("needs root to give a file to another user")
    src = tiny_source(tmp_path, 1)
    out = cbuild.build(src)  # built, not loaded: this process's dlopen has not seen the path
    evil = cbuild.build(tiny_source(tmp_path, 666, name="evil"))
    out.unlink()
    if tamper == "symlink":
        out.symlink_to(evil)
    else:
        shutil.copyfile(evil, out)
        os.chmod(out, {"group_writable": 0o775, "world_writable": 0o757}.get(tamper, 0o755))
        if tamper == "other_owner":
            os.chown(out, 12345, 12345)
    assert not cbuild.trusted(out)
    with caplog.at_level(logging.WARNING, logger="pagedlm.cbuild"):
        lib = cbuild.load(src)
    assert lib.marker() == 1
    assert "Rebuilding" in caplog.text
    st = os.lstat(out)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
    assert out.read_bytes() != evil.read_bytes()


def test_trusted_cached_library_is_reused(tmp_path, cache):
    src = tiny_source(tmp_path, 1)
    out = cbuild.build(src)
    mtime = os.stat(out).st_mtime_ns
    assert cbuild.build(src) == out and os.stat(out).st_mtime_ns == mtime


def logging_compiler(tmp_path: Path, monkeypatch, before: str) -> Path:
    """$CXX set to a g++ that appends a line to the returned log file at each compile and runs the shell `before`
    ahead of it."""
    log, fake = tmp_path / "compiles", tmp_path / "bin" / "g++"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "fake-g++ 1"; exit 0; fi\n'
                    f'echo x >> {log}; {before}; exec {shutil.which("g++")} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    return log


def compiling_builder(src: Path, log: Path, **popen) -> subprocess.Popen:
    """Another process building `src`, returned once its compiler started (its output: the library's path)."""
    other = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from pagedlm import cbuild; "
                              "print(cbuild.build(Path(sys.argv[1])))", str(src)], **popen)
    deadline = time.monotonic() + 60
    while not log.exists() and other.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.exists(), "the other process never started compiling"
    return other


def test_concurrent_builders_compile_once(tmp_path, cache, monkeypatch):
    """While another process compiles a library (a fake g++ that logs each compile and takes two seconds over it),
    three threads of this one build it too: they wait for that build and return its file; the compiler ran once."""
    log = logging_compiler(tmp_path, monkeypatch, "sleep 2")
    src = tiny_source(tmp_path, 1)
    other = compiling_builder(src, log, stdout=subprocess.PIPE, text=True)
    outs: list[Path] = []
    threads = [threading.Thread(target=lambda: outs.append(cbuild.build(src))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert other.wait(60) == 0 and Path(other.stdout.read().strip()) == outs[0]
    assert len(outs) == 3 and len(set(outs)) == 1 and cbuild.trusted(outs[0])
    assert log.read_text().count("x") == 1
    assert cbuild.load(src).marker() == 1


def test_a_builder_killed_mid_compile_leaves_nothing_behind_the_next_build(tmp_path, cache, monkeypatch):
    """A process killed while it compiles leaves its temporary directory in the cache; the next build of that library
    (holding the lock, so no other builder of it runs) removes it, compiles, and leaves no directory of its own."""
    stall = tmp_path / "stall"
    log = logging_compiler(tmp_path, monkeypatch, f"if [ -e {stall} ]; then sleep 60; fi")
    src = tiny_source(tmp_path, 1)
    stall.touch()
    killed = compiling_builder(src, log, start_new_session=True)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()

    def directories() -> list[Path]:
        return [p for p in cache.iterdir() if p.is_dir()]

    assert len(directories()) == 1, "the killed builder left its directory"
    stall.unlink()
    cbuild.build(src)
    assert cbuild.load(src).marker() == 1 and log.read_text().count("x") == 2
    assert directories() == []


def test_cache_key_changes_with_compiler_identity(tmp_path, cache, monkeypatch):
    """Same compiler path, another `--version` first line: another key, hence another library. The identity is
    asked once per process."""
    log = tmp_path / "version_calls"
    fake = tmp_path / "bin" / "g++"
    fake.parent.mkdir()

    def write_fake(version: str) -> None:
        fake.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo x >> {log}; echo "{version}"; '
                        f'echo "second line ignored"; exit 0; fi\nexec {shutil.which("g++")} "$@"\n')
        fake.chmod(0o755)

    src = tiny_source(tmp_path, 1)
    monkeypatch.setenv("CXX", str(fake))
    cbuild.compiler_identity.cache_clear()
    try:
        write_fake("fake-g++ (Debian 12.2.0-14) 12.2.0")
        first = cbuild.build(src)
        assert cbuild.build(src) == first
        assert log.read_text().count("x") == 1  # cached per process
        write_fake("fake-g++ (Debian 13.1.0-1) 13.1.0")
        assert cbuild.build(src) == first  # not asked again in this process
        cbuild.compiler_identity.cache_clear()  # a new process
        second = cbuild.build(src)
        assert second != first and second.exists() and first.exists()
        assert cbuild.compiler_identity(str(fake)) == "fake-g++ (Debian 13.1.0-1) 13.1.0"
    finally:
        cbuild.compiler_identity.cache_clear()


def test_cache_key_holds_the_abi_version(tmp_path, cache, monkeypatch):
    src = tiny_source(tmp_path, 1)
    key = cbuild.cache_key(src, cbuild.compiler())
    monkeypatch.setattr(cbuild, "ABI_VERSION", cbuild.ABI_VERSION + 1)
    assert cbuild.cache_key(src, cbuild.compiler()) != key


@pytest.mark.parametrize("abi", [cbuild.ABI_VERSION + 1, cbuild.ABI_VERSION - 1, None])
def test_abi_mismatch_is_refused(tmp_path, cache, abi, caplog):
    src = tiny_source(tmp_path, 1, abi=abi)
    message = "does not export pagedlm_abi_version" if abi is None else f"ABI version {abi}, this pagedlm needs"
    with pytest.raises(RuntimeError, match=message):
        cbuild.load(src)
    with caplog.at_level(logging.WARNING, logger="pagedlm.cbuild"):
        assert tiny_library(src).load() is None
    assert "Tiny kernel unavailable (RuntimeError" in caplog.text


def test_matching_abi_loads(tmp_path, cache):
    assert cbuild.load(tiny_source(tmp_path, 7)).marker() == 7


def test_disable_variables_skip_loading(tmp_path, cache, monkeypatch, caplog):
    src = tiny_source(tmp_path, 1)
    for var in ("PAGEDLM_DISABLE_TINY", "PAGEDLM_DISABLE_CPU_KERNEL"):  # its own, and the one for every kernel
        monkeypatch.setenv(var, "1")
        with caplog.at_level(logging.INFO, logger="pagedlm.cbuild"):
            assert tiny_library(src, disable=("PAGEDLM_DISABLE_TINY",)).load() is None
        assert f"disabled by {var}" in caplog.text
        assert not cache.exists() or not list(cache.glob("*.so"))  # not even built
        monkeypatch.delenv(var)
    assert tiny_library(src, disable=("PAGEDLM_DISABLE_TINY",)).load().marker() == 1


def test_library_is_loaded_and_configured_once(tmp_path, cache):
    configured = []
    library = tiny_library(tiny_source(tmp_path, 3), configured)
    lib = library.load()
    assert lib.marker() == 3 and configured == [lib]
    assert library.load() is lib and configured == [lib]


def test_cache_key_changes_when_an_included_file_changes(tmp_path, cache):
    """A kernel's key covers the local headers it #includes (recursively), so editing one rebuilds it."""
    src = tmp_path / "inc" / "kernel.cpp"
    src.parent.mkdir()
    (src.parent / "outer.h").write_text('#include "inner.h"\n')
    (src.parent / "inner.h").write_text("#define MARKER 1\n")
    src.write_text('#include "outer.h"\nextern "C" { int marker() { return MARKER; }\n'
                   f'int pagedlm_abi_version() {{ return {cbuild.ABI_VERSION}; }} }}\n')
    cxx = cbuild.compiler()
    key = cbuild.cache_key(src, cxx)
    first = cbuild.build(src)
    (src.parent / "inner.h").write_text("#define MARKER 2\n")
    assert cbuild.cache_key(src, cxx) != key
    second = cbuild.build(src)
    assert second != first
    assert tiny_library(src).load().marker() == 2


@pytest.mark.parametrize("broken", ["syntax_error", "no_compiler", "missing_entry_point"])
def test_broken_kernel_gives_none_and_one_warning(tmp_path, cache, monkeypatch, caplog, broken):
    """A source that does not compile, no compiler at all, or a library without an entry point `configure` declares:
    load() returns None (no exception) and warns once, naming the kernel and its fallback."""
    src = tiny_source(tmp_path, 1)
    if broken == "syntax_error":
        src.write_text(src.read_text() + "this is not C++;\n")
    elif broken == "no_compiler":
        monkeypatch.setenv("CXX", str(tmp_path / "no" / "g++"))
    else:
        src.write_text(src.read_text().replace("marker", "other"))
    library = tiny_library(src)
    with caplog.at_level(logging.WARNING, logger="pagedlm.cbuild"):
        assert library.load() is None
        assert library.load() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "Tiny kernel unavailable" in warnings[0].getMessage() and "using torch" in warnings[0].getMessage()


def test_header_and_python_agree():
    """csrc/pagedlm.h's ABI version and status codes are the ones cbuild checks and maps."""
    header = (Path(cbuild.__file__).parent / "csrc" / "pagedlm.h").read_text()
    assert int(re.search(r"#define PAGEDLM_ABI_VERSION (\d+)", header).group(1)) == cbuild.ABI_VERSION
    codes = {name: int(v) for name, v in re.findall(r"PAGEDLM_(\w+) = (-?\d+)", header)}
    assert codes == {"OK": 0, "UNSUPPORTED": cbuild.UNSUPPORTED, "BAD_BATCH": cbuild.BAD_BATCH,
                     "BAD_BLOCK": cbuild.BAD_BLOCK, "BAD_SLOT": cbuild.BAD_SLOT}


def test_kv_format_constants_agree_with_the_kernels():
    """kvcache/format.py's KVKind codes and quantized-entry scale size are the C++ kernels' numbers."""
    from pagedlm.attention.cpu_kernel import SOURCE as ATTENTION
    from pagedlm.kvcache import format

    text = ATTENTION.read_text()
    kinds = {name: int(v) for name, v in re.findall(r"(KV_\w+) = (\d+)", re.search(r"enum KVKind \{([^}]*)\}",
                                                                                      text).group(1))}
    assert kinds == {"KV_F32": format.KV_F32, "KV_BF16": format.KV_BF16, "KV_INT8": format.KV_INT8,
                     "KV_FP8": format.KV_FP8, "KV_F16": format.KV_F16}
    assert set(format.KV_KINDS.values()) == set(kinds.values())
    assert int(re.search(r"constexpr int KV_SCALE_BYTES = (\d+);", text).group(1)) == format.SCALE_BYTES


def test_every_kernel_exports_the_abi_version():
    from pagedlm.attention.cpu_kernel import SOURCE as ATTENTION
    from pagedlm.model.llama_decode import SOURCE as DECODE
    from pagedlm.model.quant import SOURCE as QUANT

    for source in (ATTENTION, QUANT, DECODE):
        lib = cbuild.load(source)
        lib.pagedlm_abi_version.restype = ctypes.c_int
        assert lib.pagedlm_abi_version() == cbuild.ABI_VERSION


def test_kernel_error_maps_status_codes():
    for rc, error, message in [(cbuild.BAD_BATCH, ValueError, "k: inconsistent batch layout"),
                               (cbuild.BAD_BLOCK, ValueError, "k: a block table entry"),
                               (cbuild.BAD_SLOT, ValueError, "k: a slot mapping entry"),
                               (cbuild.UNSUPPORTED, RuntimeError, "k: unsupported"),
                               (2, RuntimeError, "k: failed with code 2")]:
        e = cbuild.kernel_error(rc, "k")
        assert type(e) is error and str(e).startswith(message)
