"""KV memory sized to the model and the machine (kvcache/sizing.py): the default budget, the refusals before
anything is allocated, the available memory as Linux states it, and the report's new lines."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from pagedlm.cli import main
from pagedlm.config import EngineConfig
from pagedlm.engine import llm_engine, model_runner
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.kvcache.kv_cache import KVCacheSpec
from pagedlm.kvcache.sizing import (
    RUNTIME_OVERHEAD,
    UNKNOWN_MEMORY_BUDGET,
    AvailableMemory,
    KVSizing,
    available_memory,
    check_peak,
    checkpoint_bytes,
    plan_kv_budget,
)

MiB, GiB = 2**20, 2**30
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
PER_BLOCK = 16 * 1024  # 1 KiB per token (2 x 4 layers x 2 heads x 16 x 4 B) x 16 tokens


def sizing(max_model_len: int = 1024, max_num_seqs: int = 8, weights: int = 100 * MiB, **kw) -> KVSizing:
    return KVSizing(SPEC, max_model_len, max_num_seqs, weights, **kw)


def mem(n: int | None) -> AvailableMemory:
    return AvailableMemory(n, "test")


def test_default_is_the_demand_when_it_is_below_the_cap():
    b = plan_kv_budget(sizing(), mem(GiB))  # demand 8 x 1 MiB, cap 0.1 x 924 MiB = 92.4 MiB
    assert b.num_blocks == 8 * 64 and b.kv_bytes == 8 * MiB and b.demand == 8 * MiB
    assert b.cap == int(0.1 * (GiB - 100 * MiB)) and b.choice.startswith("default: the demand")
    assert b.expected_peak == 100 * MiB + 8 * MiB + RUNTIME_OVERHEAD + 10 * MiB


def test_the_cap_binds_when_the_demand_is_larger():
    b = plan_kv_budget(sizing(max_num_seqs=256), mem(GiB))  # demand 256 MiB
    assert b.num_blocks == int(0.1 * (GiB - 100 * MiB)) // PER_BLOCK and b.choice.startswith("default: the cap")
    assert "demand 256 x 1,024 tokens = 256.0 MiB" in b.choice and "0.1 x (available - weights)" in b.choice
    half = plan_kv_budget(sizing(max_num_seqs=1024, fraction=0.5), mem(GiB))
    assert half.num_blocks == int(0.5 * (GiB - 100 * MiB)) // PER_BLOCK


def test_one_full_sequence_where_it_fits_even_over_the_cap():
    s = sizing(max_model_len=2**20, weights=0)  # one sequence = 1 GiB
    b = plan_kv_budget(s, mem(2 * GiB))  # cap 205 MiB; 1 GiB fits next to the overhead
    assert b.kv_bytes == GiB and "one sequence of 1,048,576 tokens" in b.choice
    tight = plan_kv_budget(s, mem(GiB + GiB // 5))  # 1 GiB + overhead does not fit: the cap, the engine caps the length
    assert tight.kv_bytes == int(0.1 * (GiB + GiB // 5)) // PER_BLOCK * PER_BLOCK
    assert tight.choice.startswith("default: the cap")
    explicit = plan_kv_budget(sizing(max_model_len=2**20, weights=0, max_model_len_explicit=True),
                              mem(GiB + GiB // 5))  # set explicitly and fits next to the weights: honoured
    assert explicit.kv_bytes == GiB


def test_explicit_budgets_are_honoured():
    b = plan_kv_budget(sizing(kv_cache_memory=50 * MiB), mem(GiB))
    assert b.num_blocks == 50 * MiB // PER_BLOCK and b.choice == "explicit (--kv-cache-memory)"
    b = plan_kv_budget(sizing(num_kv_blocks=7), mem(GiB))
    assert b.num_blocks == 7 and b.choice == "explicit (--num-kv-blocks)"
    assert plan_kv_budget(sizing(kv_cache_memory=900 * MiB), mem(GiB)).num_blocks == 900 * MiB // PER_BLOCK


def test_an_explicit_budget_over_the_available_memory_is_refused():
    with pytest.raises(ValueError, match=r"--kv-cache-memory\) \(2.0 GiB\) and the weights \(100.0 MiB\) need "
                                         r"2.1 GiB, but only 1.0 GiB .*at most 924.0 MiB"):
        plan_kv_budget(sizing(kv_cache_memory=2 * GiB), mem(GiB))
    with pytest.raises(ValueError, match="lower --num-kv-blocks"):
        plan_kv_budget(sizing(num_kv_blocks=2**20), mem(GiB))


def test_nothing_fits_is_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"^The smallest KV cache \(one block per layer group\) \(16.0 KiB\) and "
                                         r"the weights \(2.0 GiB\) need 2.0 GiB, but only 1.0 GiB of memory is "
                                         r"available \(test\); use a smaller or more quantized model, or free memory"):
        plan_kv_budget(sizing(weights=2 * GiB), mem(GiB))
    with pytest.raises(ValueError, match=r"^The KV cache of one sequence of max_model_len 1,048,576 tokens "
                                         r"\(1.0 GiB\).*; lower --max-model-len, use a smaller"):
        plan_kv_budget(sizing(max_model_len=2**20, max_model_len_explicit=True), mem(GiB))


def test_unknown_available_memory_caps_at_the_old_default():
    b = plan_kv_budget(sizing(max_num_seqs=4096, max_model_len=2**16), mem(None))
    assert b.kv_bytes == UNKNOWN_MEMORY_BUDGET and b.choice.startswith("default: the cap")
    assert plan_kv_budget(sizing(weights=10**15, num_kv_blocks=3), mem(None)).num_blocks == 3  # no refusal


def test_cuda_keeps_eighty_percent_of_the_free_memory():
    free = 10 * GiB  # measured after the weights: no cap from host memory, no subtraction, no refusal
    b = plan_kv_budget(sizing(max_num_seqs=1, weights=100 * GiB, device_type="cuda"), mem(free))
    assert b.num_blocks == SPEC.num_blocks_for(int(free * 0.8)) and "80% of the free device memory" in b.choice
    b = plan_kv_budget(sizing(weights=100 * GiB, kv_cache_memory=GiB, device_type="cuda"), mem(free))
    assert b.num_blocks == SPEC.num_blocks_for(GiB)


def test_check_peak_warns_when_only_just_fitting(caplog):
    with caplog.at_level(logging.WARNING):
        check_peak(plan_kv_budget(sizing(kv_cache_memory=900 * MiB), mem(GiB)))
    assert "expected peak" in caplog.text and "exceeds the 1.0 GiB available" in caplog.text


# --- the memory available, as Linux states it --------------------------------------------------------------------
def fake_machine(tmp_path, cgroup: str, mem_available_kib: int = 8 * 2**20):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       33554432 kB\nMemAvailable:   {mem_available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc, root


def test_available_memory_reads_meminfo_and_the_cgroup_v2_limit(tmp_path):
    proc, root = fake_machine(tmp_path, "0::/app/worker\n")
    assert available_memory(proc, root) == AvailableMemory(8 * GiB, "MemAvailable")
    parent, own = root / "app", root / "app" / "worker"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("max\n")
    (own / "memory.current").write_text(f"{GiB}\n")
    assert available_memory(proc, root).source == "MemAvailable"  # no limit set
    (parent / "memory.max").write_text(f"{4 * GiB}\n")
    (parent / "memory.current").write_text(f"{3 * GiB}\n")
    (parent / "memory.stat").write_text(f"anon 1\ninactive_file {GiB // 2}\n")
    assert available_memory(proc, root) == AvailableMemory(GiB + GiB // 2, "cgroup limit - usage")


def test_available_memory_reads_a_cgroup_v1_limit(tmp_path):
    proc, root = fake_machine(tmp_path, "4:memory:/box\n1:cpu:/\n")
    box = root / "memory" / "box"
    box.mkdir(parents=True)
    (box / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (box / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    assert available_memory(proc, root) == AvailableMemory(GiB, "cgroup limit - usage")
    (box / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert available_memory(proc, root).source == "MemAvailable"


def test_available_memory_without_proc(tmp_path):
    m = available_memory(tmp_path / "none", tmp_path / "none")
    assert m.source in ("psutil", "sysconf", "unknown") and (m.bytes is None or m.bytes > 0)


def test_checkpoint_bytes(tmp_path, tiny_model_dir):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 1000)
    assert checkpoint_bytes(f) == 1000
    assert checkpoint_bytes(tiny_model_dir) == sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors")) > 0


def test_the_fraction_is_a_validated_flag(tmp_path):
    assert EngineConfig().kv_cache_memory_fraction == 0.1
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
            EngineConfig(kv_cache_memory_fraction=bad)


# --- the engine and `pagedlm memory` -------------------------------------------------------------------------------
@pytest.fixture
def kv_allocations(monkeypatch):
    """Every KVCache the model runner constructs."""
    calls: list[tuple] = []
    real = model_runner.KVCache

    def record(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "KVCache", record)
    return calls


def test_engine_refuses_before_loading_the_weights_or_allocating(tiny_model_dir, monkeypatch, kv_allocations):
    """What cannot fit is refused from the weights' estimated size, before they load (and again from their loaded
    size, before the KV cache is allocated, where the estimate let it through)."""
    loads = []
    real_load = model_runner.load_model
    monkeypatch.setattr(model_runner, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    monkeypatch.setattr(llm_engine, "available_memory", lambda: AvailableMemory(64 * 1024, "test"))
    with pytest.raises(ValueError, match=r"the weights \(.*\) need .*, but only 64.0 KiB of memory is available "
                                         r"\(test\)"):
        LLMEngine.from_args(str(tiny_model_dir), dtype="float32")
    monkeypatch.setattr(llm_engine, "available_memory", lambda: AvailableMemory(16 * MiB, "test"))
    with pytest.raises(ValueError, match="lower --kv-cache-memory"):
        LLMEngine.from_args(str(tiny_model_dir), dtype="float32", kv_cache_memory="1GiB")
    assert loads == [] and kv_allocations == []
    monkeypatch.setattr(llm_engine, "estimate_weight_bytes", lambda *a: 0)  # an estimate that lets anything through
    monkeypatch.setattr(llm_engine, "available_memory", lambda: AvailableMemory(MiB + 1, "test"))
    with pytest.raises(ValueError, match=r"the weights \(.*\) need .*, but only 1.0 MiB of memory is available"):
        LLMEngine.from_args(str(tiny_model_dir), dtype="float32", kv_cache_memory="1MiB")
    assert len(loads) == 1 and kv_allocations == []


def test_engine_default_budget_and_report(tiny_model_dir, monkeypatch, kv_allocations):
    monkeypatch.setattr(llm_engine, "available_memory", lambda: AvailableMemory(8 * GiB, "test"))
    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", max_num_seqs=4)
    r = eng.memory_report  # tiny LLaMA: 512 B per token, context 512: demand 4 x 256 KiB
    assert r.kv_cache_bytes == 4 * 512 * 512 and r.kv_budget.startswith("default: the demand")
    assert len(kv_allocations) == 1 and r.memory_available == 8 * GiB
    assert r.expected_peak_bytes == r.weight_bytes + r.kv_cache_bytes + r.overhead_bytes
    text = r.format()
    for line in ("KV budget          : default: the demand", "memory available   : 8.0 GiB (test)",
                 "expected peak      :"):
        assert line in text


def test_memory_command_reports_the_budget(tiny_model_dir, capsys):
    assert main(["memory", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-num-seqs", "4"]) == 0
    out = capsys.readouterr().out
    assert "KV budget          : default: the demand" in out and "memory available   :" in out
    assert "expected peak      :" in out and "refuse" not in out
    assert main(["memory", "--model", str(tiny_model_dir), "--dtype", "float32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    weights = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=8).runner.weight_bytes()
    assert r["weight_bytes"] == pytest.approx(weights, rel=0.05)
    assert r["expected_peak_bytes"] > weights + r["kv_cache_bytes"]


def test_memory_command_shows_what_the_engine_would_refuse(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("pagedlm.kvcache.sizing.available_memory", lambda: AvailableMemory(GiB, "test"))
    assert main(["memory", "--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "KV cache           : " in out and "4.0 GiB" in out
    assert "the engine would refuse to start: The KV cache asked for (--kv-cache-memory)" in out
