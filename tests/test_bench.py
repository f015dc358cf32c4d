"""Smoke tests of the benchmark code on the tiny model (fast; the real figures come from the CLI)."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from pagedlm.bench.common import format_table, make_prompts, percentile
from pagedlm.bench.serve import RequestResult, arrival_gaps, summarize


def test_prompts_and_stats():
    p = make_prompts(100, 3, 5, seed=1, avoid=[0, 1, 2])
    assert p == make_prompts(100, 3, 5, seed=1, avoid=[0, 1, 2]) and all(len(x) == 5 for x in p)
    assert all(3 <= t < 100 for x in p for t in x)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    table = format_table([{"a": "x", "b": 1.234}], [("a", "name", ""), ("b", "value", ".1f")])
    assert table.splitlines()[2].split() == ["x", "1.2"]


def test_offline_benchmarks_tiny(tiny_model_dir):
    from pagedlm.bench.backends import make_backend
    from pagedlm.bench.offline import run_latency, run_throughput
    backends = [make_backend("pagedlm", str(tiny_model_dir), "float32", {"num_kv_blocks": 64}),
                make_backend("hf", str(tiny_model_dir), "float32", {})]
    rows = run_throughput(backends, 500, [1, 3], input_len=6, output_len=5, repeats=2)
    assert [(r.backend, r.batch) for r in rows] == [("pagedlm", 1), ("hf", 1), ("pagedlm", 3), ("hf", 3)]
    assert all(r.output_tok_s > 0 and r.min_tok_s <= r.output_tok_s <= r.max_tok_s for r in rows)
    assert rows[0].ratio == 1.0
    lat = run_latency(backends, 500, input_len=6, output_len=5, repeats=1)
    assert [r.backend for r in lat] == ["pagedlm", "hf"] and all(r.ttft_ms > 0 and r.tok_s > 0 for r in lat)
    # both engines produce exactly output_len tokens per prompt
    prompts = make_prompts(500, 2, 6)
    assert backends[0].generate(prompts, 7) == backends[1].generate(prompts, 7) == 14


def test_benchmarks_never_time_a_cached_prompt(tiny_model_dir, monkeypatch):
    """Every timed call gets prompts no backend has seen before (pagedlm's prefix cache would skip their prefill),
    the same prompts for every backend of a repetition; prefill rows time only the first token."""
    from pagedlm.bench.backends import make_backend
    from pagedlm.bench.offline import run_latency, run_prefill, run_throughput
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def generate(self, prompts, max_tokens):
            calls.append((self.name, [tuple(p) for p in prompts], max_tokens))
            return len(prompts) * max_tokens

    backends = [Recorder("a"), Recorder("b")]
    run_throughput(backends, 500, [2], input_len=20, output_len=3, repeats=3)
    run_latency(backends, 500, input_len=20, output_len=3, repeats=3)
    pre = run_prefill(backends, 500, [40, 80], repeats=2)
    timed = [c for c in calls if c[2] != 4]  # warm-ups generate 4 tokens
    seen = {name: [p for n, ps, _ in timed if n == name for p in ps] for name in ("a", "b")}
    assert len(seen["a"]) == len(set(seen["a"])) == 3 * 2 + 3 * 2 + 2 * 2
    assert seen["a"] == seen["b"]  # the same prompts for every backend
    assert [(r.backend, r.prompt_len) for r in pre] == [("a", 40), ("b", 40), ("a", 80), ("b", 80)]
    assert all(mt == 1 for _, _, mt in calls[-8:]) and all(r.tok_s > 0 for r in pre)
    llm = make_backend("pagedlm", str(tiny_model_dir), "float32", {"num_kv_blocks": 64})
    run_latency([llm], 500, input_len=20, output_len=3, repeats=2)
    assert llm.llm.engine.block_manager.prefix_hits == 0


def test_cli_throughput_json(tiny_model_dir, tmp_path):
    from pagedlm.cli import main
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", str(tiny_model_dir), "--dtype", "float32", "--backends", "pagedlm",
               "--num-prompts", "2", "--input-len", "4", "--output-len", "3", "--repeats", "1",
               "--num-kv-blocks", "32", "--output-json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["benchmark"] == "throughput" and data["rows"][0]["batch"] == 2


def test_kernel_benchmark_tiny():
    from pagedlm.bench.kernel import bench_kernel, format_kernel
    res = bench_kernel("cpu", batches=(2,), contexts=(40,), repeats=3)
    assert len(res) == 1 and res[0].paged_us > 0 and "ratio" in format_kernel(res)


def test_serve_summary_and_arrivals():
    import random
    gaps = arrival_gaps(2000, 10.0, "poisson", random.Random(0))
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01
    assert arrival_gaps(3, 4.0, "fixed", random.Random(0)) == [0.25] * 3
    assert arrival_gaps(2, float("inf"), "poisson", random.Random(0)) == [0.0, 0.0]
    rs = [RequestResult(True, 4, 5, ttft=0.1, e2e=0.5, itl=[0.1] * 4), RequestResult(True, 4, 5, ttft=0.3, e2e=1.3),
          RequestResult(False, 4, error="HTTP 500")]
    s = summarize(rs, 2.0, sla_ttft_ms=200)
    assert s["completed"] == 2 and s["failed"] == 1 and s["goodput"] == 0.5
    assert s["tpot_ms"]["median"] == pytest.approx(175.0) and s["output_throughput"] == 5.0
    json.dumps(s)


def test_serve_benchmark_against_server(tiny_model_dir):
    """The load generator against the real OpenAI-compatible server (streaming, ignore_eos, usage)."""
    import asyncio

    from server_utils import ServerProcess

    from pagedlm.bench.serve import run_load
    srv = ServerProcess("--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64").wait_ready()
    try:
        prompts = make_prompts(500, 4, 5, seed=2)
        results, duration = asyncio.run(run_load(srv.url, None, prompts, 6, rate=50.0, arrival="poisson",
                                                 max_concurrency=2))
    finally:
        srv.stop()
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [6] * 4
    s = summarize(results, duration)
    assert s["completed"] == 4 and s["ttft_ms"]["p99"] >= s["ttft_ms"]["median"] > 0
    assert all(asdict(r)["e2e"] >= r.ttft for r in results)


def test_speculative_bench_sends_concurrent_requests(tiny_model_dir, tmp_path):
    """`bench speculative --concurrency 4`: each run's tokens are four requests' (batched), the same with and
    without drafting."""
    from pagedlm.cli import main
    out = tmp_path / "spec.json"
    assert main(["bench", "speculative", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks",
                 "256", "--repeats", "1", "--output-len", "6", "--concurrency", "4", "--speculative-config",
                 '{"method": "suffix", "num_speculative_tokens": 3}', "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["workload"] for r in rows] == ["code-edit+prediction", "code-edit-1-line+prediction",
                                                "quote-summary+suffix", "open-chat+suffix"]
    assert all(r["concurrency"] == 4 and 4 < r["tokens"] <= 4 * 6 and r["same"] for r in rows)
    assert json.loads(out.read_text())["llama_cpp"] == []


def test_speculative_bench_against_llama_cpp(smollm2_path, tmp_path):
    """`bench speculative --llama-cpp`: llama.cpp without a draft and with its prompt lookup on the same prompts."""
    pytest.importorskip("llama_cpp")
    from pagedlm.cli import main
    out = tmp_path / "spec.json"
    assert main(["bench", "speculative", "--model", str(smollm2_path), "--repeats", "1", "--output-len", "12",
                 "--llama-cpp", "--output-json", str(out)]) == 0
    peer = json.loads(out.read_text())["llama_cpp"]
    assert [(r["workload"], r["side"]) for r in peer[:3]] == [
        ("code-edit", "llama.cpp"), ("code-edit", "llama.cpp lookup 10"), ("code-edit", "llama.cpp lookup 2")]
    assert len(peer) == 12 and all(0 < r["tokens"] <= 12 and r["rate"] > 0 for r in peer)
    assert all(r["acceptance"] is None for r in peer[::3])
    quote = [r for r in peer if r["workload"] == "quote-summary" and r["side"] != "llama.cpp"]
    assert all(r["acceptance"] is not None for r in quote)  # the summary quotes its prompt: lookup drafts
