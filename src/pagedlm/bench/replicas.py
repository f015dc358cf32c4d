"""Replica benchmarks (issue 17): `python -m pagedlm.bench.replicas batch|tenants [options]`.

batch: one engine on `--threads` torch threads vs `--replicas` Ray replicas (each cores / replicas threads), the
same greedy batch (`--prompts` x `--max-tokens`, ignore_eos); prints output tokens/s of each.
simulate: the router's cost per decision and memory at 8 and 64 replicas (no engines).
tenants: `--tenants` distinct long system prompts, requests interleaved in waves of `--wave`, on the replicas
under each `--policies` policy (fresh prompts per policy): prefix-cache hit rate and mean / p90 TTFT.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedlm import LLM, SamplingParams
from pagedlm.config import DEFAULT_MODEL

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega").split()


def _prompts(n: int) -> list[str]:
    return [f"Story {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(24)) for i in range(n)]


def batch(args: argparse.Namespace) -> dict:
    import torch

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = _prompts(args.prompts)
    out = {}
    torch.set_num_threads(args.threads)
    one = LLM(model=args.model, dtype=args.dtype)
    one.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    t = time.perf_counter()
    a = one.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    out[f"1 engine x {args.threads} threads"] = round(args.prompts * args.max_tokens / dt, 1)
    print(json.dumps(out), flush=True)
    del one
    dp = LLM(model=args.model, dtype=args.dtype, data_parallel_size=args.replicas)
    try:
        dp.generate(prompts[:2 * args.replicas], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        t = time.perf_counter()
        b = dp.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        threads = next(iter(dp.replicas.replicas.values())).info.num_threads
        out[f"{args.replicas} replicas x {threads} threads"] = round(args.prompts * args.max_tokens / dt, 1)
        same = [next((j for j, (x, y) in enumerate(zip(p.outputs[0].token_ids, q.outputs[0].token_ids)) if x != y),
                     None) for p, q in zip(a, b)]
        out["prompts with identical outputs"] = f"{same.count(None)} / {len(same)}"
        out["first differing token of the others"] = [j for j in same if j is not None]
    finally:
        dp.shutdown()
    return {"output tokens/s": out}


def tenants(args: argparse.Namespace) -> dict:
    from pagedlm.dp.placement import REPLICA_POLICIES

    dp = LLM(model=args.model, dtype=args.dtype, data_parallel_size=args.replicas)
    rs = dp.replicas
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    try:
        for k, name in enumerate(args.policies.split(",")):
            rs.policy = REPLICA_POLICIES[name]()
            systems = [f"[{name} tenant {t}] You are assistant number {t}. " + " ".join(
                WORDS[(t * 7 + j * (t + 3)) % len(WORDS)] for j in range(args.system_words))
                for t in range(args.tenants)]
            reqs = [f"{systems[i % args.tenants]}\nUser question {i}: what is {WORDS[i % len(WORDS)]}?"
                    for i in range(args.requests)]
            before = [(c.stats.prefix_cache_hits, c.stats.prefix_cache_queries) for c in rs.replicas.values()]
            ttft = []
            for w in range(0, len(reqs), args.wave):
                outs = dp.generate(reqs[w:w + args.wave], params, use_tqdm=False)
                ttft += [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
                time.sleep(0.6)  # let the replicas publish their caches (one poll)
            hits = sum(c.stats.prefix_cache_hits - b[0] for c, b in zip(rs.replicas.values(), before))
            queries = sum(c.stats.prefix_cache_queries - b[1] for c, b in zip(rs.replicas.values(), before))
            ttft.sort()
            results[name] = {"prefix hit rate": round(hits / max(queries, 1), 3),
                             "mean TTFT ms": round(1000 * statistics.mean(ttft), 1),
                             "p90 TTFT ms": round(1000 * ttft[int(0.9 * (len(ttft) - 1))], 1)}
    finally:
        dp.shutdown()
    return results


def simulate(args: argparse.Namespace) -> dict:
    """The router alone, over stand-in replicas whose published caches hold `--cache-blocks` hashes each: time
    per decision (hashing the prompt + matching every replica + the policy) and the router's memory for it."""
    import random
    import sys
    from types import SimpleNamespace

    from pagedlm.dp.client import ReplicaClient
    from pagedlm.dp.prefix_index import PrefixIndex, prompt_block_hashes
    from pagedlm.dp.replica_set import ReplicaRequest, ReplicaSet
    from pagedlm.engine.llm_engine import EngineStats

    rng = random.Random(0)
    out = {}
    prompt = [rng.randrange(50_000) for _ in range(args.prompt_tokens)]
    for n in (8, 64):
        for cache in (1_000, args.cache_blocks):
            reps = []
            for i in range(n):
                rep = object.__new__(ReplicaClient)  # a client without an actor: only what routing reads
                rep.name, rep.healthy, rep._stop, rep._streams = str(i), True, SimpleNamespace(is_set=lambda: False), {}
                info = SimpleNamespace(kv=SimpleNamespace(block_size=16), prefix_caching=True)
                rep.stats = EngineStats(rng.randrange(8), 0, 0, 0.5, 5000, 10_000, 0, 0, 0, 0, 0)
                rep.prefix = PrefixIndex()
                rep.prefix.cached = {rng.getrandbits(64) for _ in range(cache)}
                rep.on_lost, rep.input_processor = None, SimpleNamespace(info=info, tokenizer=None)
                rep.max_waiting, rep.stall_timeout, rep._listeners = 512, 0.0, []
                reps.append(rep)
            rs = ReplicaSet(reps)
            hashes = prompt_block_hashes(prompt, 16)
            reps[n // 2].prefix.cached.update(hashes[: len(hashes) // 2])  # one replica holds half the prompt
            reps_n = 200
            t = time.perf_counter()
            for _ in range(reps_n):
                h = prompt_block_hashes(prompt, 16)
                d = rs.choose(ReplicaRequest(None, len(prompt), h), set())
            per = (time.perf_counter() - t) / reps_n
            t = time.perf_counter()
            for _ in range(reps_n):
                prompt_block_hashes(prompt, 16)
            hash_s = (time.perf_counter() - t) / reps_n
            mem = sum(sys.getsizeof(r.prefix.cached) + 32 * len(r.prefix.cached) for r in reps)
            assert d.replica == str(n // 2)
            out[f"{n} replicas x {cache} cached blocks"] = {
                "decision ms": round(1000 * per, 3), "of which hashing the prompt ms": round(1000 * hash_s, 3),
                "router memory MiB": round(mem / 2**20, 1), "snapshot per replica KiB": round(8 * cache / 1024, 1)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pagedlm.bench.replicas", description=__doc__)
    p.add_argument("what", choices=["batch", "tenants", "simulate"])
    p.add_argument("--cache-blocks", type=int, default=100_000)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--wave", type=int, default=4)
    p.add_argument("--policies", default="prefix,round-robin")
    args = p.parse_args(argv)
    print(json.dumps({"batch": batch, "tenants": tenants, "simulate": simulate}[args.what](args), indent=2))


if __name__ == "__main__":
    main()
