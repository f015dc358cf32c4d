"""`pagedlm serve | generate | memory | pull | bench | router`."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pagedlm.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig

LIMIT_FLAGS = {  # per-request limits: EngineConfig fields, flags of the same name
    "max_logprobs": "largest logprobs / prompt_logprobs / top_logprobs a request may ask for",
    "max_stop_sequences": "most stop strings (and, separately, stop token ids) per request",
    "max_stop_length": "longest stop string, in characters",
}


def _engine_args(p: argparse.ArgumentParser, multi_model: bool = False) -> None:
    if multi_model:
        p.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                       help="model name (e.g. smollm2-135m), .gguf file or HF directory; repeat to serve several")
    else:
        p.add_argument("--model", default=None, help="model name (e.g. smollm2-135m), .gguf file or HF directory")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--swap-space", default="1GiB")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="weight-only quantization of the linear layers")
    p.add_argument("--quantization-group-size", type=int, default=32, help="int4 group size (multiple of 32)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kernel-max-rows", type=int, default=None,
                   help="quantized weights: steps of at most this many rows run the quantized kernels, larger ones "
                        "a dense GEMM (default: measured once per CPU)")
    for name, doc in LIMIT_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=EngineConfig.__dataclass_fields__[name].default,
                       help=f"{doc} (default %(default)s)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    from pagedlm.hub.registry import DEFAULT_MODEL
    return dict(model=args.model or DEFAULT_MODEL, dtype=args.dtype, device=args.device, block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, preemption_mode=args.preemption_mode,
                swap_space=args.swap_space, attention_backend=args.attention_backend,
                quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                kv_cache_dtype=args.kv_cache_dtype, kernel_max_rows=args.kernel_max_rows,
                **{name: getattr(args, name) for name in LIMIT_FLAGS})


def cmd_pull(args: argparse.Namespace) -> int:
    from pagedlm.hub.registry import pull
    print(pull(args.name))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedlm import LLM, SamplingParams
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def cmd_memory(args: argparse.Namespace) -> int:

    from pagedlm.config import EngineConfig, ModelConfig, parse_bytes
    from pagedlm.hub.loader import load_hf_config
    from pagedlm.hub.registry import DEFAULT_MODEL, resolve_model
    from pagedlm.kvcache.kv_cache import KVCacheSpec
    from pagedlm.kvcache.memory import MemoryReport
    from pagedlm.model.plan import plan_execution

    target = args.model or DEFAULT_MODEL
    path = Path(target)
    if path.is_file() and path.suffix == ".json":
        hf, checkpoint = json.loads(path.read_text()), None
    else:
        checkpoint = resolve_model(target)
        hf = load_hf_config(checkpoint)
    cfg = ModelConfig.from_hf(hf)
    plan = plan_execution(EngineConfig(model=target, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype),
                          checkpoint, measure=False)
    spec = KVCacheSpec.for_model(cfg, args.block_size, plan.dtype, plan.kv_cache_dtype)
    budget = parse_bytes(args.kv_cache_memory or "2GiB")
    max_len = args.max_model_len or cfg.context_length
    report = MemoryReport.build(cfg, spec, spec.num_blocks_for(budget), 0, max_len,
                                weight_bytes=cfg.num_parameters() * plan.dtype.itemsize)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedlm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pull", help="fetch a model into the local cache")
    p.add_argument("name")
    p.set_defaults(fn=cmd_pull)

    p = sub.add_parser("generate", help="complete one prompt")
    p.add_argument("prompt")
    _engine_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("memory", help="KV cache arithmetic for a model or an HF config.json")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_memory)

    from pagedlm.bench.cli import add_bench_parser
    from pagedlm.router.cli import add_router_parser
    from pagedlm.server.cli import add_serve_parser

    add_serve_parser(sub, _engine_args, engine_kwargs)
    add_bench_parser(sub, _engine_args, engine_kwargs)
    add_router_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
