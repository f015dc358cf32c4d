"""The repacked-weight cache (model/weight_cache.py): a second load maps what the first converted; a tampered, stale
or untrusted file is rebuilt, never used; the weights, and so what the engine generates, are the same with it and
without it."""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import gguf
import pytest
import torch
from test_loading_memory import write_random_llama

from pagedlm.config import KERNEL_MAX_ROWS
from pagedlm.model import load_model, quant, weight_file
from pagedlm.model.quant import QuantLinear

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if quant.load_quant_kernel() is None:
        pytest.skip("no compiler for the kernel (nothing is repacked)")


@pytest.fixture(scope="module")
def models(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random LLaMAs (hidden 256, 2 layers) whose linear weights are Q4_0 (int4 x16), Q4_K (its own x16
    scales) or Q8_0 (GGUFLinear), with SmolLM2's vocabulary as a Q8_0 table."""
    d = tmp_path_factory.mktemp("weight_cache")
    return {q.name: write_random_llama(d / f"{q.name}.gguf", smollm2_path, 256, 2, 4, 2, 512, q)
            for q in (Q.Q4_0, Q.Q4_K, Q.Q8_0)}


@pytest.fixture
def model(models: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the Q4_0 model this test may touch."""
    return Path(shutil.copy2(models["Q4_0"], tmp_path / "model.gguf"))


def _load(path: Path, cache: Path | None):
    """The default plan's load (the file's blocks as stored), the cache file written before it returns."""
    model, _ = load_model(path, torch.float32, torch.device("cpu"), "int4", 32, None, KERNEL_MAX_ROWS, native=True,
                          weight_cache_dir=cache)
    if model.weight_cache is not None:
        model.weight_cache.wait()
    return model


def _weights(model) -> dict[str, bytes]:
    """Every quantized layer's buffers, as bytes."""
    return {f"{name}.{b}": t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for name, m in model.named_modules() if isinstance(m, QuantLinear)
            for b, t in m.named_buffers(recurse=False)}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q8_0"])
def test_second_load_maps_what_the_first_converted(kind: str, models: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "weights"
    first = _load(models[kind], cache)
    stats = first.weight_cache
    assert stats.misses > 0 and stats.hits == 0 and stats.written and stats.rejected is None
    assert stat.S_IMODE(stats.path.stat().st_mode) == 0o600 and stat.S_IMODE(cache.stat().st_mode) == 0o700
    second = _load(models[kind], cache)
    assert (second.weight_cache.hits, second.weight_cache.misses) == (stats.misses, 0)
    assert not second.weight_cache.written  # nothing new: the file is left as it is
    reference = _weights(_load(models[kind], None))
    assert _weights(first) == reference and _weights(second) == reference


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


TAMPER = {
    "data": lambda p: _flip(p, 0),  # the first bytes of the first buffer
    "index": lambda p: _flip(p, p.stat().st_size - weight_file.TRAILER.size - 10),
    "truncated": lambda p: os.truncate(p, p.stat().st_size - 4096),
    "group-writable": lambda p: os.chmod(p, 0o620),
}


@pytest.mark.parametrize("how", TAMPER)
def test_a_tampered_file_is_rebuilt_not_used(how: str, model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "weights"
    n = _load(model, cache).weight_cache.misses
    path = _load(model, cache).weight_cache.path
    TAMPER[how](path)
    rebuilt = _load(model, cache)
    stats = rebuilt.weight_cache
    assert stats.rejected and (stats.hits, stats.misses) == (0, n) and stats.written
    assert _weights(rebuilt) == _weights(_load(model, None))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (_load(model, cache).weight_cache.hits, _load(model, cache).weight_cache.rejected) == (n, None)


STALE = {
    "mtime_ns": lambda path, mp: os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9)),
    "layouts": lambda path, mp: mp.setattr(weight_file, "_layout_digest", lambda: "another layout"),
    "kernel": lambda path, mp: mp.setattr(weight_file, "_kernel_key", lambda: "another kernel"),
    "format": lambda path, mp: mp.setattr(weight_file, "FORMAT_VERSION", weight_file.FORMAT_VERSION + 1),
}


@pytest.mark.parametrize("what", STALE)
def test_a_stale_file_is_rebuilt_not_used(what: str, model: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A file built from another version of the model file, or by another kernel or layout version, is replaced."""
    cache = tmp_path / "weights"
    n = _load(model, cache).weight_cache.misses
    STALE[what](model, monkeypatch)
    stats = _load(model, cache).weight_cache
    assert "stale" in stats.rejected and what in stats.rejected
    assert (stats.hits, stats.misses) == (0, n) and stats.written
    assert _load(model, cache).weight_cache.hits == n


def test_greedy_output_is_the_same_with_and_without_the_cache(model: Path, tmp_path: Path) -> None:
    from pagedlm import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs, stats = [], []
    for setting in ("off", tmp_path / "weights", tmp_path / "weights"):  # none, written, mapped
        llm = LLM(model=str(model), weight_cache=str(setting), kernel_max_rows=KERNEL_MAX_ROWS,
                  kv_cache_memory="16MiB", max_model_len=256)
        outputs.append(llm.generate([[5, 17, 300, 42]], params, use_tqdm=False)[0].outputs[0].token_ids)
        stats.append(llm.engine.runner.model.weight_cache)
        if stats[-1] is not None:
            stats[-1].wait()
    assert stats[0] is None and stats[1].misses and stats[2].hits == stats[1].misses and not stats[2].misses
    assert len(outputs[0]) == 8 and outputs[0] == outputs[1] == outputs[2]


def test_files_of_deleted_models_are_removed(model: Path, tmp_path: Path, models: dict[str, Path]) -> None:
    cache = tmp_path / "weights"
    gone = _load(model, cache).weight_cache.path
    model.unlink()
    _load(models["Q8_0"], cache)  # writing another file clears the orphans
    assert not gone.exists() and len(list(cache.glob("*.bin"))) == 1


def test_an_unusable_directory_turns_the_cache_off(model: Path, tmp_path: Path, caplog) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    loaded = _load(model, not_a_dir)
    assert loaded.weight_cache is None and "Repacked-weight cache off" in caplog.text
    assert _weights(loaded) == _weights(_load(model, None))


def _load_within(path: Path, cache: Path, budget: int):
    model, _ = load_model(path, torch.float32, torch.device("cpu"), "int4", 32, None, KERNEL_MAX_ROWS, native=True,
                          weight_cache_dir=cache, weight_cache_budget=budget)
    model.weight_cache.wait()
    return model.weight_cache


def test_the_files_stay_within_the_budget_least_recently_used_first(models: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "weights"
    sizes = {k: _load_within(models[k], tmp_path / k, 2**40).path.stat().st_size for k in ("Q4_0", "Q4_K", "Q8_0")}
    budget = sizes["Q4_0"] + sizes["Q4_K"] + sizes["Q8_0"] // 2  # any two fit beside each other, not three
    q40, q4k = (_load_within(models[k], cache, budget).path for k in ("Q4_0", "Q4_K"))
    os.utime(q40, (1, 1)), os.utime(q4k, (2, 2))
    assert _load_within(models["Q4_0"], cache, budget).hits  # a start that maps Q4_0's file makes it the newest
    q80 = _load_within(models["Q8_0"], cache, budget)
    assert q80.written and q40.exists() and not q4k.exists()  # the least recently used went
    assert sum(f.stat().st_size for f in cache.glob("*.bin")) <= budget


def test_a_file_over_the_budget_is_not_written(model: Path, tmp_path: Path, caplog) -> None:
    stats = _load_within(model, tmp_path / "weights", 4096)
    assert stats.misses and not stats.written and not stats.path.exists()
    assert "not cached" in caplog.text and "budget" in caplog.text
