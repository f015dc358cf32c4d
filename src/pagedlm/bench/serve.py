"""`pagedlm bench serve`: a load generator for any OpenAI-compatible server (like `vllm bench serve`).

Requests (random token-id prompts of `input_len`, `output_len` tokens each, EOS ignored) are streamed from
`/v1/completions`; arrivals are Poisson (`--request-rate R`, exponential gaps of mean 1/R), evenly spaced
(`--arrival fixed`) or all at once (`inf`), optionally capped by `--max-concurrency`. Per request it records
TTFT (send -> first token), TPOT ((e2e - TTFT) / (tokens - 1)), the inter-token gaps and the end-to-end
latency; it reports median/p90/p99, throughput, and goodput: completed requests per second meeting every SLA.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field

from pagedlm.bench.common import format_table, make_prompts, median, percentile, write_json


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def arrival_gaps(n: int, rate: float, kind: str, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: Poisson (exponential gaps), fixed (1/rate) or none (rate inf)."""
    if rate == float("inf"):
        return [0.0] * n
    if kind == "fixed":
        return [1.0 / rate] * n
    return [rng.expovariate(rate) for _ in range(n)]


async def _one(client, url: str, payload: dict, prompt_len: int) -> RequestResult:
    res = RequestResult(ok=False, prompt_len=prompt_len)
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.output_tokens = msg["usage"].get("completion_tokens", res.output_tokens)
                choices = msg.get("choices") or []
                if not choices or not (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


async def served_model(client, base_url: str, model: str | None) -> str:
    """`model`, or the first of the server's GET /v1/models (`base_url` without /v1). ValueError when the server
    cannot be reached or does not answer with an OpenAI model list."""
    import httpx
    try:
        resp = await client.get(f"{base_url}/v1/models", timeout=30.0)
    except httpx.TransportError as e:
        raise ValueError(f"cannot reach {base_url}: {e or type(e).__name__}") from None
    if model is not None:
        return model
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{base_url}/v1/models answered HTTP {resp.status_code} without a model list: give "
                         f"--base-url the root of an OpenAI-compatible server, or --served-model") from None


async def run_load(base_url: str, model: str | None, prompts: list[list[int]], output_len: int, rate: float,
                   arrival: str, max_concurrency: int | None, seed: int = 0, ignore_eos: bool = True,
                   timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every prompt to `base_url` (with or without a trailing /v1); returns the per-request results and the
    wall time of the whole run."""
    import httpx
    base = base_url.rstrip("/").removesuffix("/v1")
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = await served_model(client, base, model)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        gaps = arrival_gaps(len(prompts), rate, arrival, random.Random(seed))

        async def send(p: list[int]) -> RequestResult:
            payload = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}
            if ignore_eos:
                payload["ignore_eos"] = True
            if sem is None:
                return await _one(client, f"{base}/v1/completions", payload, len(p))
            async with sem:
                return await _one(client, f"{base}/v1/completions", payload, len(p))

        start = time.perf_counter()
        tasks = []
        for p, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(send(p)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, sla_ttft_ms: float | None = None,
              sla_tpot_ms: float | None = None, sla_e2e_ms: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def stats(xs: list[float]) -> dict[str, float]:
        ms = [x * 1e3 for x in xs]
        return {"mean": sum(ms) / len(ms) if ms else float("nan"), "median": median(ms),
                "p90": percentile(ms, 90), "p99": percentile(ms, 99)}

    def meets(r: RequestResult) -> bool:
        return ((sla_ttft_ms is None or r.ttft * 1e3 <= sla_ttft_ms)
                and (sla_tpot_ms is None or (r.tpot or 0.0) * 1e3 <= sla_tpot_ms)
                and (sla_e2e_ms is None or r.e2e * 1e3 <= sla_e2e_ms))

    good = [r for r in ok if meets(r)]
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration if duration else 0.0,
        "goodput": len(good) / duration if duration else 0.0,
        "sla": {"ttft_ms": sla_ttft_ms, "tpot_ms": sla_tpot_ms, "e2e_ms": sla_e2e_ms},
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats([g for r in ok for g in r.itl]),
        "e2e_ms": stats([r.e2e for r in ok]),
    }


def format_summary(s: dict) -> str:
    head = (f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s\n"
            f"request throughput {s['request_throughput']:.2f} req/s  output {s['output_throughput']:.1f} tok/s  "
            f"total {s['total_token_throughput']:.1f} tok/s  goodput {s['goodput']:.2f} req/s")
    rows = [{"metric": k.removesuffix("_ms").upper(), **s[k]} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
    cols = [("metric", "ms", ""), ("mean", "mean", ".1f"), ("median", "median", ".1f"), ("p90", "p90", ".1f"),
            ("p99", "p99", ".1f")]
    errors = "".join(f"\nerror: {e}" for e in s["errors"])
    return head + "\n" + format_table(rows, cols) + errors


def cmd_serve_bench(args) -> int:
    for name in ("httpx", "httpcore"):  # one INFO line per request otherwise: the report is what is printed
        logging.getLogger(name).setLevel(logging.WARNING)
    prompts = make_prompts(args.vocab_size, args.num_prompts, args.input_len, args.seed)
    results, duration = asyncio.run(run_load(args.base_url, args.served_model, prompts, args.output_len,
                                             args.request_rate, args.arrival, args.max_concurrency, args.seed,
                                             not args.no_ignore_eos))
    summary = summarize(results, duration, args.sla_ttft_ms, args.sla_tpot_ms, args.sla_e2e_ms)
    print(format_summary(summary))
    write_json(args.output_json, {"benchmark": "serve", "base_url": args.base_url, "num_prompts": args.num_prompts,
                                  "input_len": args.input_len, "output_len": args.output_len,
                                  "request_rate": args.request_rate, "arrival": args.arrival,
                                  "max_concurrency": args.max_concurrency, **summary,
                                  "requests": [asdict(r) for r in results] if args.save_requests else None})
    return 0 if summary["failed"] == 0 else 1
