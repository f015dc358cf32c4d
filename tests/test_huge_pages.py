"""Quantized weights in 2 MiB pages (model/huge_pages.py): converted into memory advised MADV_HUGEPAGE at a first
start, mapped from the repacked-weight cache at a second (the mapping advised so, the file written in 2 MiB pieces),
the same bytes either way and as without huge pages."""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import gguf
import pytest
import torch
from test_loading_memory import write_random_llama

from pagedlm.config import KERNEL_MAX_ROWS
from pagedlm.model import huge_pages, load_model, quant, weight_file
from pagedlm.model.quant import QuantLinear

Q = gguf.GGMLQuantizationType


def _advised_spans() -> list[tuple[int, int]]:
    """This process's mappings whose VmFlags say MADV_HUGEPAGE ("hg")."""
    spans, span = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = head.split("-")
                span = (int(lo, 16), int(hi, 16))
            elif head == "VmFlags:" and "hg" in line.split()[1:]:
                spans.append(span)
    return spans


def _buffers(model) -> dict[str, torch.Tensor]:
    return {f"{name}.{b}": t for name, m in model.named_modules() if isinstance(m, QuantLinear)
            for b, t in m.named_buffers(recurse=False) if t.numel()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _in_huge_pages(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    start = t.data_ptr()
    return any(lo <= start and start + t.numel() * t.element_size() <= hi for lo, hi in spans)


@pytest.fixture(scope="module")
def model_path(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if quant.load_quant_kernel() is None:
        pytest.skip("no compiler for the kernel (nothing is repacked)")
    return write_random_llama(tmp_path_factory.mktemp("huge") / "q4k.gguf", smollm2_path, 256, 2, 4, 2, 512, Q.Q4_K)


def _file_folios_map_huge(tmp_path: Path) -> bool:
    """Whether this OS maps a file written in 2 MiB pieces in 2 MiB pages (Linux with THP and large folios for the
    file system: ext4, xfs, ...)."""
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(4 << 20))
    with open(probe, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    huge_pages.populate(m)
    try:
        return huge_pages.file_pmd_mapped(m) > 0
    finally:
        m.close()


def _load(path: Path, cache: Path | None, huge: bool):
    model, _ = load_model(path, torch.float32, torch.device("cpu"), "int4", 32, None, KERNEL_MAX_ROWS, native=True,
                          weight_cache_dir=cache, huge_pages=huge)
    if model.weight_cache is not None:
        model.weight_cache.wait()
    return model


def test_weights_converted_and_cached_live_in_huge_pages(model_path: Path, tmp_path: Path) -> None:
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this OS")
    cache = tmp_path / "weights"
    first = _load(model_path, cache, True)
    second = _load(model_path, cache, True)
    assert first.weight_cache.misses and second.weight_cache.hits and not second.weight_cache.misses
    plain = _buffers(_load(model_path, None, False))
    spans = _advised_spans()
    for model in (first, second):
        held = _buffers(model)
        assert held.keys() == plain.keys()
        for name, t in held.items():
            assert _in_huge_pages(t, spans), name
            assert torch.equal(_bytes(t), _bytes(plain[name])), name  # bytes: random fp16 scales hold NaNs
    if _file_folios_map_huge(tmp_path):  # the second load's buffers are mapped from the file, in 2 MiB pages
        assert second.weight_cache.huge_bytes >= 2 << 20
        assert second.weight_cache.huge_bytes > second.weight_cache.path.stat().st_size // 2


def test_huge_pages_off_keeps_the_mapped_cache(model_path: Path, tmp_path: Path) -> None:
    cache = tmp_path / "weights"
    _load(model_path, cache, False)
    mapped = _load(model_path, cache, False)
    assert mapped.weight_cache.hits and not mapped.weight_cache.huge_bytes
    held = _buffers(mapped)
    assert held and not any(_in_huge_pages(t, _advised_spans()) for t in held.values())  # mapped, not advised
    with open("/proc/self/maps") as f:
        assert str(mapped.weight_cache.path) in f.read()


def test_arena_carves_aligned_tensors() -> None:
    arena = huge_pages.HugePageArena(chunk=1 << 21)
    a = arena.empty((3, 5), torch.float16)
    b = arena.empty((1 << 19,), torch.int32)  # 2 MiB: beyond the first chunk's rest, a mapping of its own
    c = arena.empty((0, 4), torch.float32)
    assert a.shape == (3, 5) and a.dtype == torch.float16 and b.numel() == 1 << 19 and c.numel() == 0
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    a.fill_(1.5)
    b.fill_(7)
    assert a.sum().item() == 22.5 and arena.bytes == 30 + (2 << 20)


@pytest.mark.parametrize("pieces", [[1, 4096, 3 << 20, 5, 4 << 20], [2 << 20], [100], [3] * 1500])
def test_the_cache_file_is_written_in_2_mib_pieces(pieces: list[int], tmp_path: Path, monkeypatch) -> None:
    writes = []
    real = os.pwritev
    monkeypatch.setattr(weight_file.os, "pwritev", lambda fd, parts, at: writes.append(
        (at, sum(memoryview(p).nbytes for p in parts))) or real(fd, parts, at))
    data = [os.urandom(n) for n in pieces]
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        out = weight_file._ChunkedWriter(fd)
        for d in data:
            out.put(memoryview(d))
        out.flush()
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(data) and out.pos == sum(pieces)
    chunk = huge_pages.HUGE_PAGE
    assert all(at % chunk == 0 and (n % chunk == 0 or at + n == out.pos) for at, n in writes)
    if out.pos >= chunk and _file_folios_map_huge(tmp_path):
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        huge_pages.populate(m)
        assert huge_pages.file_pmd_mapped(m) == out.pos // chunk * chunk
        m.close()
