"""A draft model's memory made visible and counted (speculative decoding, kvcache/sizing.py `DraftSizing`): the
fit check refuses a target + draft that cannot fit before any KV cache is allocated, and the start-up report,
`pagedlm memory`, the engine snapshot (/debug/state, /ui, `pagedlm top`) show the draft's weights and KV cache with
the numbers of its actual tensors and block pool."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pagedlm import SamplingParams
from pagedlm.cli import main
from pagedlm.engine import llm_engine, model_runner
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.snapshot import build_snapshot
from pagedlm.kvcache.kv_cache import KVCacheSpec
from pagedlm.kvcache.sizing import AvailableMemory, DraftSizing, KVSizing, checkpoint_bytes, plan_kv_budget

MiB, GiB = 2**20, 2**30
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)  # 16 KiB a block
DRAFT_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32)  # 4 KiB
UI = Path(__file__).resolve().parent.parent / "src" / "pagedlm" / "server" / "static" / "ui"


def draft(weights: int = 50 * MiB, seqs: int = 4, k: int = 4) -> DraftSizing:
    return DraftSizing("draft", DRAFT_SPEC, weights, seqs, k)


def sizing(d: DraftSizing | None = None, max_model_len: int = 1024, max_num_seqs: int = 8, **kw) -> KVSizing:
    return KVSizing(SPEC, max_model_len, max_num_seqs, 100 * MiB, draft=d, **kw)


def mem(n: int | None) -> AvailableMemory:
    return AvailableMemory(n, "test")


def test_draft_kv_follows_the_target_and_is_counted_in_the_budget():
    d = draft()
    # as many tokens as the target, at most 4 sequences of 1,024 + 4, and a block per sequence
    assert d.num_blocks(10 * 16, 1024) == 10 + 4
    assert d.num_blocks(10**6, 1024) == -(-4 * 1028 // 16) + 4
    s = sizing(d, max_num_seqs=128)
    assert s.draft_blocks(64) == d.num_blocks(64 * 16, 1024)
    b = plan_kv_budget(s, mem(GiB))  # the demand (128 x 1 MiB + the draft's) is over the cap: the cap binds both
    assert b.choice.startswith("default: the cap") and "with the draft model's KV" in b.choice
    assert b.draft_blocks == s.draft_blocks(b.num_blocks) and b.draft_bytes_per_block == 4 * 1024
    assert b.kv_bytes + b.draft_kv_bytes <= b.cap < s.kv_bytes(b.num_blocks + 1)
    assert b.cap == int(0.1 * (GiB - 150 * MiB))  # the draft's weights are weights
    assert b.expected_peak == 150 * MiB + b.kv_bytes + b.draft_kv_bytes + b.overhead_bytes
    assert b.overhead_bytes == plan_kv_budget(sizing(draft(0), max_num_seqs=128), mem(GiB)).overhead_bytes + 5 * MiB
    small = plan_kv_budget(sizing(d), mem(GiB))  # 8 x 1 MiB and the draft's 4 sequences fit: the demand
    assert small.num_blocks == 8 * 64 and small.draft_blocks == d.num_blocks(8 * 1024, 1024)
    assert small.demand == 8 * MiB + small.draft_kv_bytes
    explicit = plan_kv_budget(sizing(d, num_kv_blocks=100), mem(GiB))  # explicit: the target's, the draft on top
    assert explicit.num_blocks == 100 and explicit.draft_blocks == d.num_blocks(1600, 1024)


def test_target_and_draft_that_cannot_fit_are_refused():
    """Each configuration fits without the draft model and is refused with it, naming both."""
    cases = [  # (sizing, available memory, the draft's weights)
        (dict(), 100 * MiB + 32 * 1024 + 10 * MiB, 50 * MiB),  # its weights leave no room for the smallest caches
        (dict(num_kv_blocks=1000), 100 * MiB + 1000 * 16 * 1024 + MiB, MiB // 2),  # its KV beside an explicit cache
        (dict(max_model_len=2048, max_model_len_explicit=True), 102 * MiB + 100 * 1024, 0),  # its KV beside a sequence
    ]
    for kw, available, weights in cases:
        plan_kv_budget(sizing(None, **kw), mem(available))
        with pytest.raises(ValueError, match=r"with the draft model's .*, the draft model's [^)]+\)"):
            plan_kv_budget(sizing(draft(weights), **kw), mem(available))


@pytest.fixture
def kv_allocations(monkeypatch):
    """Every KVCache a model runner constructs (the target's and the draft's)."""
    calls: list[tuple] = []
    real = model_runner.KVCache
    monkeypatch.setattr(model_runner, "KVCache", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


def draft_kwargs(model_dir, **kw) -> dict:
    return dict(dtype="float32", block_size=4, speculative_config={
        "method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3, **kw})


def test_engine_refuses_a_draft_that_does_not_fit_before_allocating(tiny_2k_model_dir, monkeypatch, kv_allocations):
    probe = LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", block_size=4, num_kv_blocks=16)
    weights, per_block = probe.runner.weight_bytes(), probe.runner.kv_spec.bytes_per_block
    kv_allocations.clear()
    available = weights + 512 * per_block + weights // 2  # the target and its cache fit; the draft's weights do not
    monkeypatch.setattr(llm_engine, "available_memory", lambda: AvailableMemory(available, "test"))
    with pytest.raises(ValueError, match="with the draft model's"):
        LLMEngine.from_args(str(tiny_2k_model_dir), num_kv_blocks=512, **draft_kwargs(tiny_2k_model_dir))
    assert kv_allocations == []
    LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", block_size=4, num_kv_blocks=512)  # alone: fits


@pytest.fixture(scope="module")
def engine(tiny_2k_model_dir):
    return LLMEngine.from_args(str(tiny_2k_model_dir), num_kv_blocks=128, max_num_seqs=8,
                               **draft_kwargs(tiny_2k_model_dir, disable_by_batch_size=2))


def test_start_up_report_shows_the_drafts_actual_memory(engine, tiny_2k_model_dir, caplog):
    draft, r = engine.draft, engine.memory_report
    pool = engine.spec.drafter.bm
    assert r.draft_model == str(tiny_2k_model_dir) and r.draft_max_seqs == 2
    assert r.draft_weight_bytes == draft.runner.weight_bytes() > 0
    assert r.draft_num_blocks == pool.num_total_blocks == draft.runner.kv_cache.gpu.shape[2]
    assert r.draft_num_blocks == 128 + 2  # the target's 128 x 4 tokens (fewer than 2 x 2,051), a block per drafter
    assert r.draft_kv_cache_bytes == draft.runner.kv_cache.gpu.nbytes == r.draft_num_blocks * r.draft_bytes_per_block
    assert r.draft_kv_bytes_per_token == draft.runner.kv_spec.bytes_per_token
    assert r.expected_peak_bytes == (r.weight_bytes + r.kv_cache_bytes + r.draft_weight_bytes
                                     + r.draft_kv_cache_bytes + r.overhead_bytes)
    text = r.format()
    assert f"draft model        : {tiny_2k_model_dir}: weights " in text
    assert f"its KV cache {r.draft_num_blocks:,} blocks of 2.0 KiB" in text and "+ draft KV cache" in text
    with caplog.at_level(logging.INFO, logger="pagedlm.engine.llm_engine"):  # the start-up log is the report
        LLMEngine.from_args(str(tiny_2k_model_dir), num_kv_blocks=16, **draft_kwargs(tiny_2k_model_dir))
    assert "draft model        :" in caplog.text


def test_snapshot_shows_the_draft_pool(engine):
    pool = engine.spec.drafter.bm
    engine.add_request("d", "The engine schedules requests, batches prompts together " * 4,
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        snap = build_snapshot(engine)
        d = snap.draft
        assert (d.num_blocks, d.num_free) == (pool.num_total_blocks, pool.num_free_blocks)
        assert d.num_used == pool.num_total_blocks - pool.num_free_blocks and d.num_seqs == engine.spec.drafter.num_seqs
        used.append(d.num_used)
    assert max(used) > 0 and used[-1] == 0  # the sequence held draft blocks, and gave them up
    r = engine.memory_report
    assert (d.weights, d.kv_cache, d.per_block) == (r.draft_weight_bytes, r.draft_kv_cache_bytes,
                                                    r.draft_bytes_per_block)
    assert snap.to_dict()["draft"]["num_blocks"] == pool.num_total_blocks
    assert build_snapshot(LLMEngine.from_args(str(engine.model_path), dtype="float32", num_kv_blocks=8)).draft is None


def test_memory_command_reports_the_draft(engine, tiny_2k_model_dir, capsys):
    """`pagedlm memory` plans the draft's cache as the engine does (its weights estimated from the checkpoint)."""
    spec = json.dumps({"method": "draft_model", "model": str(tiny_2k_model_dir), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 2})
    flags = ["--model", str(tiny_2k_model_dir), "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "128",
             "--max-num-seqs", "8", "--speculative-config", spec]
    capsys.readouterr()
    assert main(["memory", *flags, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    r = engine.memory_report
    assert d["draft_weight_bytes"] == pytest.approx(r.draft_weight_bytes, rel=0.05)
    for key in ("draft_num_blocks", "draft_bytes_per_block", "draft_kv_cache_bytes", "draft_kv_bytes_per_token",
                "draft_max_seqs"):
        assert d[key] == getattr(r, key), key
    assert main(["memory", *flags]) == 0
    assert "draft model        :" in capsys.readouterr().out


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_memory_command_counts_a_quantized_drafts_weights_as_loaded(tiny_2k_model_dir, quantization, capsys):
    """A draft (and a target) quantized from an fp32 checkpoint: `pagedlm memory` estimates its weights in the
    format the engine holds them (int4 about a sixth of the file), near what the engine then reports, not the
    checkpoint's size on disk."""
    spec = {"method": "draft_model", "model": str(tiny_2k_model_dir), "num_speculative_tokens": 3,
            "quantization": quantization}
    for target in (None, quantization):
        kw = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=4)
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
        flags += [f"--quantization={target}"] if target else []
        capsys.readouterr()
        assert main(["memory", "--model", str(tiny_2k_model_dir), *flags, "--speculative-config", json.dumps(spec),
                     "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        r = LLMEngine.from_args(str(tiny_2k_model_dir), quantization=target, speculative_config=spec,
                                **kw).memory_report
        assert r.draft_weight_bytes < checkpoint_bytes(tiny_2k_model_dir) / (3 if quantization == "int4" else 2)
        assert d["draft_weight_bytes"] == pytest.approx(r.draft_weight_bytes, rel=0.1)
        assert d["weight_bytes"] == pytest.approx(r.weight_bytes, rel=0.1)


SNAP = {"counters": {"preemptions": 0, "cow_blocks": 0, "swapped_out_blocks": 0, "swapped_in_blocks": 0,
                     "prefix_queries": 0, "prefix_hits": 0, "prefix_evictions": 0, "prompt_tokens": 0,
                     "generation_tokens": 0},
        "memory": {"weights": 2048, "kv_cache": 4096, "per_block": 64, "host_rss": None}, "prefix_caching": False,
        "draft": {"model": "tiny-draft", "weights": 3 * MiB, "kv_cache": 5 * MiB, "per_block": 1024,
                  "num_blocks": 5120, "num_used": 37, "num_free": 5083, "num_seqs": 2}}


def test_top_shows_the_draft():
    from rich.console import Console

    from pagedlm.server.top import TopView

    console = Console(record=True, width=140, force_terminal=False)
    console.print(TopView(width=140).live_panel(SNAP))
    text = console.export_text()
    assert "draft weights / KV" in text and "3.0 MiB / 5.0 MiB" in text and "37/5120 used · 2 seqs" in text
    console = Console(record=True, width=140, force_terminal=False)
    console.print(TopView(width=140).live_panel({**SNAP, "draft": None}))
    assert "draft" not in console.export_text()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_web_view_shows_the_draft():
    """panels.js's counters (with app.js's helpers) on a minimal DOM, under node."""
    harness = """
    const made = [];
    function node() { const n = {children: [], textContent: "", dataset: {}, hidden: false,
      classList: {add() {}, remove() {}}, append(...c) { this.children.push(...c); },
      replaceChildren(...c) { this.children = c; }, addEventListener() {}}; made.push(n); return n; }
    const nodes = {};
    globalThis.document = {getElementById: (id) => (nodes[id] = nodes[id] || node()),
                           createElement: () => node(), addEventListener() {}};
    globalThis.window = globalThis; globalThis.location = {hash: "", search: ""};
    """
    script = (harness + (UI / "app.js").read_text() + (UI / "panels.js").read_text()
              + f"\nrenderCounters({json.dumps(SNAP)});\n"
              + "console.log(JSON.stringify(nodes.counters.children.map(tr => tr.children.map(c => c.textContent))));")
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    assert rows["draft model"] == "tiny-draft" and rows["draft weights"] == "3.0 MiB"
    assert rows["draft KV cache"] == "37 of 5120 blocks used, 2 sequences (5.0 MiB)"
