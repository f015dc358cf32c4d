"""The `pagedlm bench` sub-commands; cli.py calls `add_bench_parser`."""
from __future__ import annotations

import argparse
import json
from typing import Callable


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (argparse reports the message as a usage error)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def positive_ints(text: str) -> list[int]:
    """An argparse type: a comma list of integers of at least 1, e.g. 1,4,16."""
    return [positive_int(x.strip()) for x in text.split(",")]


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (inf allowed)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return x


def add_bench_parser(sub, engine_args: Callable[[argparse.ArgumentParser], None],
                     engine_kwargs: Callable[[argparse.Namespace], dict]) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, kernel")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)

    def offline(name: str, help: str, output_len: int, repeats: int) -> argparse.ArgumentParser:
        q = bsub.add_parser(name, help=help)
        engine_args(q)
        q.add_argument("--backends", default="pagedlm,hf",
                       help="comma list of pagedlm, hf, llama.cpp (run alternately)")
        q.add_argument("--input-len", type=positive_int, default=32)
        q.add_argument("--output-len", type=positive_int, default=output_len)
        q.add_argument("--repeats", type=positive_int, default=repeats,
                       help="repetitions per backend; medians reported")
        # the engine's --seed also seeds the workload
        q.add_argument("--output-json", default=None)
        return q

    q = offline("throughput", "offline batch throughput, backends side by side", 128, 3)
    q.add_argument("--num-prompts", type=positive_int, default=64)
    q.add_argument("--batch-sizes", type=positive_ints, default=None,
                   help="e.g. 1,4,16,64: one run per size (default: --num-prompts)")
    q.add_argument("--plot", default=None, help="write a PNG of throughput against batch size (needs matplotlib)")
    q.set_defaults(fn=lambda a: _offline("cmd_throughput", a, engine_kwargs))

    q = offline("latency", "single-stream latency, backends side by side", 128, 5)
    q.add_argument("--prefill-lens", type=positive_ints, default=None,
                   help="also time the prefill of new prompts of these lengths, e.g. 512,2048,8000")
    q.add_argument("--prefill-repeats", type=positive_int, default=3)
    q.set_defaults(fn=lambda a: _offline("cmd_latency", a, engine_kwargs))

    q = bsub.add_parser("speculative", help="speculative decoding vs the defaults, single stream, alternated")
    engine_args(q)
    q.add_argument("--k", type=positive_int, default=4, help="draft tokens without --speculative-config")
    q.add_argument("--output-len", type=positive_int, default=128)
    q.add_argument("--repeats", type=positive_int, default=3, help="runs per mode and workload; medians reported")
    q.add_argument("--concurrency", type=positive_int, default=1, help="requests sent at once per run (batched)")
    q.add_argument("--llama-cpp", action="store_true",
                   help="also llama.cpp without a draft and with its prompt lookup, alternated (needs a .gguf)")
    q.add_argument("--output-json", default=None)
    q.set_defaults(fn=lambda a: _speculative(a, engine_kwargs))

    q = bsub.add_parser("serve", help="load generator for an OpenAI-compatible server")
    q.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL (a trailing /v1 is "
                   "dropped: the benchmark adds /v1/completions)")
    q.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    q.add_argument("--num-prompts", type=positive_int, default=100)
    q.add_argument("--input-len", type=positive_int, default=32)
    q.add_argument("--output-len", type=positive_int, default=128)
    q.add_argument("--vocab-size", type=positive_int, default=32000, help="prompt token ids are drawn below this")
    q.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="requests/s (inf: all at once)")
    q.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    q.add_argument("--max-concurrency", type=positive_int, default=None)
    q.add_argument("--sla-ttft-ms", type=positive_float, default=None)
    q.add_argument("--sla-tpot-ms", type=positive_float, default=None)
    q.add_argument("--sla-e2e-ms", type=positive_float, default=None)
    q.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (plain OpenAI servers)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--output-json", default=None)
    q.add_argument("--save-requests", action="store_true", help="include per-request records in the JSON")
    q.set_defaults(fn=_serve)

    q = bsub.add_parser("kernel", help="paged decode attention vs SDPA on contiguous K/V")
    q.add_argument("--backend", default="cpu")
    q.add_argument("--dtype", default="float32")
    q.add_argument("--batches", type=positive_ints, default="1,16,64")
    q.add_argument("--contexts", type=positive_ints, default="128,1024,4096")
    q.add_argument("--repeats", type=positive_int, default=30)
    q.add_argument("--output-json", default=None)
    q.set_defaults(fn=_kernel)


def _offline(name: str, args: argparse.Namespace, engine_kwargs) -> int:
    from pagedlm.bench import offline
    return getattr(offline, name)(args, engine_kwargs)


def _speculative(args: argparse.Namespace, engine_kwargs) -> int:
    from pagedlm.bench.speculative import cmd_speculative
    return cmd_speculative(args, engine_kwargs)


def _serve(args: argparse.Namespace) -> int:
    from pagedlm.bench.serve import cmd_serve_bench
    return cmd_serve_bench(args)


def _kernel(args: argparse.Namespace) -> int:
    from pagedlm.bench.kernel import bench_kernel, format_kernel, to_json
    from pagedlm.config import parse_dtype
    results = bench_kernel(args.backend, args.batches, args.contexts, parse_dtype(args.dtype), args.repeats)
    print(format_kernel(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(to_json(results), f, indent=2)
    return 0
