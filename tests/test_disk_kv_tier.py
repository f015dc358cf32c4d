"""The prefix cache's disk tier (--kv-cache-dir): KV blocks outlive the engine, are found by another engine, and a
file that is truncated, corrupted, foreign or half written is never used."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_utils import InProcessServer

from pagedlm.config import EngineConfig, LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.protocol import OutputAccumulator
from pagedlm.kvcache.disk_format import RunHeader
from pagedlm.kvcache.disk_tier import DiskTier
from pagedlm.kvcache.run_files import STALE_TMP_SECONDS
from pagedlm.sampling.params import SamplingParams
from pagedlm.server.api import build_app

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
BS = 4


def engine(model_dir: Path, cache_dir: Path | None, kv_cache_dtype: str = "float32", **kw) -> LLMEngine:
    return LLMEngine.from_args(str(model_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=BS,
                               num_kv_blocks=256, kv_cache_dir=None if cache_dir is None else str(cache_dir), **kw)


def generate(eng: LLMEngine, prompts: list[list[int]], salt: str | None = None) -> list[tuple[list[int], float]]:
    accs = {}
    for prompt in prompts:
        rid = f"r{len(accs)}-{id(prompt)}-{eng.get_stats().prompt_tokens}"
        eng.add_request(rid, prompt, GREEDY, cache_salt=salt)
        accs[rid] = OutputAccumulator(rid)
    while eng.has_unfinished_requests():
        for delta in eng.step():
            accs[delta.request_id].add(delta)
    outs = [acc.output().outputs[0] for acc in accs.values()]
    return [(o.token_ids, o.cumulative_logprob) for o in outs]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    tok = engine(tiny_model_dir, None).tokenizer
    system = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 3
    return [tok.encode(system + q) for q in ("Hello! How are you today?", "What is the capital of France?")]


@pytest.fixture(scope="module")
def computed(tiny_model_dir, prompts) -> dict[str, list]:
    """Outputs with every KV computed (no disk tier), per KV dtype."""
    return {dt: [generate(engine(tiny_model_dir, None, dt), [p])[0] for p in prompts]
            for dt in ("float32", "int8", "bfloat16", "float16")}


def close_to(a: list[tuple[list[int], float]], b: list[tuple[list[int], float]]) -> bool:
    return all(x[0] == y[0] and abs(x[1] - y[1]) < 1e-4 for x, y in zip(a, b, strict=True))


def disk_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS  # the block with the last token is always computed


def run_files(cache_dir: Path) -> list[Path]:
    """Each run file once (by inode), largest first."""
    files = {}
    for p in cache_dir.rglob("*.kv"):
        files.setdefault(p.stat().st_ino, p)
    return sorted(files.values(), key=lambda p: -p.stat().st_size)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "bfloat16", "float16"])
def test_restart_round_trip(tiny_model_dir, prompts, computed, tmp_path, kv_dtype):
    first = engine(tiny_model_dir, tmp_path, kv_dtype)
    assert close_to(generate(first, prompts[:1]), computed[kv_dtype][:1])
    assert first.get_stats().disk.hit_blocks == 0
    first.close()  # its writes are on disk
    restarted = engine(tiny_model_dir, tmp_path, kv_dtype)
    assert close_to(generate(restarted, prompts[:1]), computed[kv_dtype][:1])
    stats = restarted.get_stats()
    assert stats.disk.hit_blocks == disk_blocks(prompts[0])
    assert stats.disk.bytes_read == stats.disk.hit_blocks * restarted.runner.kv_spec.bytes_per_block
    assert stats.prefix_cache_hits == disk_blocks(prompts[0]) * BS
    # the second prompt shares the first one's system prompt: its part on disk loads, the rest is computed
    assert close_to(generate(restarted, prompts[1:]), computed[kv_dtype][1:])
    mode = stat.S_IMODE
    assert mode(os.stat(tmp_path).st_mode) == 0o700 and mode(os.stat(run_files(tmp_path)[0]).st_mode) == 0o600


def test_prefix_spread_over_several_run_files_loads_whole(tiny_model_dir, prompts, computed, tmp_path,
                                                         monkeypatch):
    import pagedlm.engine.kv_offload as kv_offload

    first = engine(tiny_model_dir, tmp_path)
    monkeypatch.setattr(kv_offload, "_MAX_RUN_BYTES", 3 * first.runner.kv_spec.bytes_per_block)
    generate(first, prompts[:1])
    first.close()
    assert len(run_files(tmp_path)) >= disk_blocks(prompts[0]) // 3
    eng = engine(tiny_model_dir, tmp_path)
    assert close_to(generate(eng, prompts[:1]), computed["float32"][:1])
    assert eng.get_stats().disk.hit_blocks == disk_blocks(prompts[0])


def test_load_waits_aside_while_other_requests_step(tiny_model_dir, prompts, computed, tmp_path):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1])
    first.close()
    eng = engine(tiny_model_dir, tmp_path)
    tok = eng.tokenizer
    eng.add_request("other", tok.encode("Once upon a time"), GREEDY)
    eng.step()  # "other" is prefilled
    eng.add_request("disk", prompts[0], GREEDY)
    eng.step()
    assert [r.request_id for r in eng.scheduler.loading] == ["disk"]
    assert eng.scheduler.running[0].seqs[0].output_token_ids  # "other" went on decoding
    acc = OutputAccumulator("disk")
    while eng.has_unfinished_requests():
        for d in eng.step():
            if d.request_id == "disk":
                acc.add(d)
    out = acc.output().outputs[0]
    assert close_to([(out.token_ids, out.cumulative_logprob)], computed["float32"][:1])
    assert eng.get_stats().disk.hit_blocks == disk_blocks(prompts[0])


def test_abort_while_loading_leaks_nothing(tiny_model_dir, prompts, tmp_path):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1])
    first.close()
    eng = engine(tiny_model_dir, tmp_path)
    eng.add_request("disk", prompts[0], GREEDY)
    eng.step()
    assert eng.scheduler.loading and eng.has_unfinished_requests()
    eng.abort_request("disk")
    assert not eng.scheduler.loading and not eng.has_unfinished_requests()
    eng.offload.loads["disk"].future.result()
    eng.step()  # the finished load is dropped, nothing is allocated for it
    assert not eng.offload.loads and not eng.offload.tried
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    assert not eng.block_manager.gpu.cached


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_damaged_file_is_recomputed_and_removed(tiny_model_dir, prompts, computed, tmp_path, damage):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1])
    first.close()
    victim = run_files(tmp_path)[0]  # the prompt's run
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x40
    elif damage == "truncate":
        data = data[:-1000]
    else:
        data[20] ^= 0x01
    victim.write_bytes(bytes(data))  # every name of the run sees it (hard links)
    eng = engine(tiny_model_dir, tmp_path)
    assert close_to(generate(eng, prompts[:1]), computed["float32"][:1])
    disk = eng.get_stats().disk
    assert disk.corrupt_files == 1
    assert not victim.exists() or victim.read_bytes() != bytes(data)  # removed (and written again, computed)
    if damage == "flip":  # the records before the damaged one were good
        assert 0 < disk.hit_blocks < disk_blocks(prompts[0])
    else:
        assert disk.hit_blocks == 0


def test_half_written_file_of_a_killed_writer_is_never_read(tiny_model_dir, prompts, computed, tmp_path):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1])
    first.close()
    # a killed writer leaves its temporary file, never a final name: simulate one holding half of a run
    run = run_files(tmp_path)[0]
    names = [p for p in run.parent.iterdir() if p.stat().st_ino == run.stat().st_ino]
    tmp = run.parent / f".{run.stem}.99999.deadbeef.tmp"
    tmp.write_bytes(run.read_bytes()[: run.stat().st_size // 2])
    for name in names:
        name.unlink()
    eng = engine(tiny_model_dir, tmp_path)
    assert close_to(generate(eng, prompts[:1]), computed["float32"][:1])
    assert eng.get_stats().disk.hit_blocks == 0 and eng.get_stats().disk.corrupt_files == 0
    eng.close()
    old = os.stat(tmp).st_mtime - STALE_TMP_SECONDS - 1
    os.utime(tmp, (old, old))
    engine(tiny_model_dir, tmp_path)  # the start-up scan removes a dead writer's leftovers
    assert not tmp.exists()


_WRITER = """
import sys, torch
from pagedlm.kvcache.disk_tier import DiskTier
tier = DiskTier(sys.argv[1], 1 << 40, {"model": "crash"}, record_bytes=1 << 20)
for run in range(1 << 20):
    hashes = [run.to_bytes(8, "little") + bytes([i]) * 24 for i in range(8)]
    tier.submit(0, hashes, [[run, i] for i in range(8)], torch.randint(0, 255, (8, 1 << 20), dtype=torch.uint8))
    if run == 2:
        tier.flush()
        print("writing", flush=True)
"""


def test_killed_writer_leaves_no_file_read_as_valid_but_whole_ones(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline() == b"writing\n"
    proc.send_signal(signal.SIGKILL)  # somewhere in the middle of a write
    proc.wait()
    tier = DiskTier(tmp_path, 1 << 40, {"model": "crash"}, record_bytes=1 << 20)
    names = list(tier.dir.glob("*.kv"))
    assert len(names) >= 3 * 8
    for name in names:  # every file under a final name is whole and checks out
        with open(name, "rb") as f:
            hdr = RunHeader.decode(f.read, os.fstat(f.fileno()).st_size)
        assert tier.load(hdr.hashes, hdr.tokens, 0, hdr.count).count == hdr.count
    assert tier.stats.corrupt_files == 0


def test_salts_are_isolated(tiny_model_dir, prompts, tmp_path):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1], salt="tenant-a")
    first.close()
    eng = engine(tiny_model_dir, tmp_path)
    generate(eng, prompts[:1], salt="tenant-b")
    generate(eng, prompts[:1])
    assert eng.get_stats().disk.hit_blocks == 0
    eng2 = engine(tiny_model_dir, tmp_path)
    generate(eng2, prompts[:1], salt="tenant-a")
    assert eng2.get_stats().disk.hit_blocks == disk_blocks(prompts[0])


def test_other_model_or_kv_dtype_never_matches(tiny_model_dir, prompts, computed, tmp_path):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1])
    first.close()
    other = engine(tiny_model_dir, tmp_path, "int8")  # another KV dtype: another namespace
    generate(other, prompts[:1])
    assert other.get_stats().disk.hit_blocks == 0
    other.close()
    # a file planted under this engine's names but written for another identity is rejected
    mine = engine(tiny_model_dir, tmp_path)
    theirs = next(d for d in tmp_path.iterdir() if d != mine.offload.tier.dir)
    for p in mine.offload.tier.dir.iterdir():
        p.unlink()
    for p in theirs.iterdir():  # each block's file linked under the name this engine looks for
        with open(p, "rb") as f:
            hdr = RunHeader.decode(f.read, os.fstat(f.fileno()).st_size)
        assert hdr.identity["kv_dtype"] == "torch.int8"
        name = mine.offload.tier.path(hdr.hashes[0])
        if not name.exists():
            os.link(p, name)
    assert close_to(generate(mine, prompts[:1]), computed["float32"][:1])
    assert mine.get_stats().disk.hit_blocks == 0 and mine.get_stats().disk.corrupt_files == 1


def test_two_engines_share_a_directory(tiny_model_dir, prompts, computed, tmp_path):
    a, b = engine(tiny_model_dir, tmp_path), engine(tiny_model_dir, tmp_path)  # both started before any write
    assert close_to(generate(a, prompts[:1]), computed["float32"][:1])
    a.offload.tier.flush()
    assert close_to(generate(b, prompts[:1]), computed["float32"][:1])
    assert b.get_stats().disk.hit_blocks == disk_blocks(prompts[0])
    # and back: what b computed (the second prompt's own blocks) a finds
    generate(b, prompts[1:])
    b.offload.tier.flush()
    a2_hits = a.get_stats().disk.hit_blocks
    a.block_manager.gpu.cached.clear()  # forget a's memory copies so that it must read the disk
    for i in range(a.block_manager.gpu.num_blocks):
        a.block_manager.gpu.block_hash[i] = a.block_manager.gpu.block_tokens[i] = None
    assert close_to(generate(a, prompts[1:]), computed["float32"][1:])
    assert a.get_stats().disk.hit_blocks - a2_hits == disk_blocks(prompts[1])


def test_load_is_skipped_when_recomputing_is_faster(tiny_model_dir, prompts, computed, tmp_path):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1])
    first.close()
    eng = engine(tiny_model_dir, tmp_path)
    eng.offload.read_rate, eng.offload.prefill_rate = 1.0, 1e9  # bytes/s, tokens/s
    assert close_to(generate(eng, prompts[:1]), computed["float32"][:1])
    disk = eng.get_stats().disk
    assert disk.skipped == 1 and disk.hit_blocks == 0


def _tier(root: Path, budget: int, identity: dict | None = None) -> DiskTier:
    return DiskTier(root, budget, identity or {"model": "m"}, record_bytes=1000)


def _write_run(tier: DiskTier, tag: int, n: int = 2) -> list[bytes]:
    hashes = [bytes([tag, i]) * 16 for i in range(n)]
    records = torch.full((n, 1000), tag, dtype=torch.uint8)
    assert tier.submit(0, hashes, [[tag, i] for i in range(n)], records)
    assert tier.flush()
    return hashes


def test_budget_evicts_least_recently_used(tmp_path):
    tier = _tier(tmp_path, budget=3 * 8192)  # a run of 2 records is one page of header + 2000 bytes
    runs = [_write_run(tier, t) for t in range(3)]
    assert tier.stats.num_files == 3
    os.utime(tier.path(runs[0][0]), (1, 1))
    os.utime(tier.path(runs[1][0]), (2, 2))
    os.utime(tier.path(runs[2][0]), (3, 3))
    assert tier.load(runs[0], [[0, 0], [0, 1]], 0, 2).count == 2  # a hit makes run 0 the most recent
    tier.budget = 2 * 8192
    _write_run(tier, 3)
    assert tier.stats.evicted_files == 2 and tier.stats.usage_bytes <= tier.budget
    assert tier.probe(runs[0], 0) == 2 and tier.probe(runs[1], 0) == 0 and tier.probe(runs[2], 0) == 0
    loaded = tier.load(runs[0], [[0, 0], [0, 1]], 1, 1)  # from the middle of a run
    assert loaded.count == 1 and bool((loaded.records == 0).all())


def test_full_write_queue_drops_instead_of_blocking(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30, {"model": "m"}, record_bytes=1000, max_pending_bytes=1000)
    tier._queue.put(None)  # stop the writer: nothing leaves the queue
    tier._writer.join()
    assert tier.submit(0, [b"a" * 32], [[1]], torch.zeros((1, 1000), dtype=torch.uint8))
    assert not tier.submit(1, [b"b" * 32], [[2]], torch.zeros((1, 1000), dtype=torch.uint8))
    assert tier.stats.writes_dropped == 1


def test_foreign_identity_file_is_rejected(tmp_path):
    a, b = _tier(tmp_path, 1 << 30, {"model": "a"}), _tier(tmp_path, 1 << 30, {"model": "b"})
    hashes = _write_run(a, 7)
    assert b.probe(hashes, 0) == 0  # another namespace
    os.link(a.path(hashes[0]), b.path(hashes[0]))  # planted under b's name
    assert b.load(hashes, [[7, 0], [7, 1]], 0, 2).count == 0 and b.stats.corrupt_files == 1
    assert not b.path(hashes[0]).exists() and a.probe(hashes, 0) == 2


def test_config_is_checked(tmp_path):
    for bad in ("abc", "0", "-1GiB"):
        with pytest.raises(ValueError, match="kv_disk_budget|memory size"):
            EngineConfig(kv_cache_dir=str(tmp_path), kv_disk_budget=bad)
    with pytest.raises(ValueError, match="kv_cache_dir"):
        EngineConfig(kv_cache_dir=" ")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="KV cache directory"):
        _tier(tmp_path / "file", 1 << 20)


def test_off_for_sliding_window_models(tmp_path):
    from conftest import build_tiny_gemma3

    eng = LLMEngine.from_args(str(build_tiny_gemma3(tmp_path / "gemma", sliding_window=8)), dtype="float32",
                              num_kv_blocks=64, kv_cache_dir=str(tmp_path / "kv"))
    assert eng.offload is None and eng.get_stats().disk is None


def test_directory_must_be_this_users(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ValueError, match="not a directory owned by this user"):
        _tier(link, 1 << 20)


def test_metrics_show_the_disk_tier(tiny_model_dir, prompts, tmp_path):
    first = engine(tiny_model_dir, tmp_path)
    generate(first, prompts[:1])
    first.close()
    served = AsyncLLMEngine(engine(tiny_model_dir, tmp_path), LoopConfig.offline(log_interval=0))
    server = InProcessServer(build_app({"tiny": served}))
    try:
        r = server.post("/v1/completions", json={"model": "tiny", "prompt": prompts[0], "max_tokens": 2,
                                                 "temperature": 0})
        assert r.status_code == 200
        m = server.wait_idle()
        assert m["pagedlm:kv_disk_hit_blocks_total"] == disk_blocks(prompts[0])
        block_bytes = served.engine.runner.kv_spec.bytes_per_block
        assert m["pagedlm:kv_disk_read_bytes_total"] == disk_blocks(prompts[0]) * block_bytes
        assert m["pagedlm:kv_disk_lookups_total"] == 1 and m["pagedlm:kv_disk_files"] >= 1
        assert m["pagedlm:kv_disk_usage_bytes"] > 0
    finally:
        server.stop()
        served.shutdown()
