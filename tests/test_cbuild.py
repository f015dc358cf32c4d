"""The kernel cache (cbuild.py): a private per-user directory, only trusted libraries loaded, the compiler's
identity and the ABI version in the key, the ABI version checked after loading."""
from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import stat
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
        assert cbuild.load_optional(tiny_source(tmp_path, 2), "Tiny kernel", "using torch") is None
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
    assert not cbuild._trusted(out)
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
        assert cbuild.load_optional(src, "Tiny kernel", "using torch") is None
    assert "Tiny kernel unavailable (RuntimeError" in caplog.text


def test_matching_abi_loads(tmp_path, cache):
    assert cbuild.load(tiny_source(tmp_path, 7)).marker() == 7


def test_disable_variables_skip_loading(tmp_path, cache, monkeypatch, caplog):
    src = tiny_source(tmp_path, 1)
    monkeypatch.setenv("PAGEDLM_DISABLE_TINY", "1")
    with caplog.at_level(logging.INFO, logger="pagedlm.cbuild"):
        assert cbuild.load_optional(src, "Tiny kernel", "using torch", disable=("PAGEDLM_DISABLE_TINY",)) is None
    assert "disabled by PAGEDLM_DISABLE_TINY" in caplog.text
    assert not cache.exists() or not list(cache.glob("*.so"))  # not even built
    monkeypatch.delenv("PAGEDLM_DISABLE_TINY")
    assert cbuild.load_optional(src, "Tiny kernel", "using torch", disable=("PAGEDLM_DISABLE_TINY",)).marker() == 1


def test_header_and_python_agree():
    """csrc/pagedlm.h's ABI version and status codes are the ones cbuild checks and maps."""
    header = (Path(cbuild.__file__).parent / "csrc" / "pagedlm.h").read_text()
    assert int(re.search(r"#define PAGEDLM_ABI_VERSION (\d+)", header).group(1)) == cbuild.ABI_VERSION
    codes = {name: int(v) for name, v in re.findall(r"PAGEDLM_(\w+) = (-?\d+)", header)}
    assert codes == {"OK": 0, "UNSUPPORTED": cbuild.UNSUPPORTED, "BAD_BATCH": cbuild.BAD_BATCH,
                     "BAD_BLOCK": cbuild.BAD_BLOCK, "BAD_SLOT": cbuild.BAD_SLOT}


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
