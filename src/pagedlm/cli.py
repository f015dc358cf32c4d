"""`pagedlm serve | chat | run-batch | generate | memory | pull | bench | router | top`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pagedlm.config import DEFAULT_MODEL, EngineConfig, add_arguments, from_args

MEMORY_FIELDS = ("model", "dtype", "block_size", "kv_cache_memory", "kv_cache_memory_fraction", "num_kv_blocks",
                 "max_model_len", "max_num_seqs", "kv_cache_dtype", "quantization", "quantization_group_size",
                 "speculative_config")


def _engine_args(p: argparse.ArgumentParser, multi_model: bool = False, only: Sequence[str] | None = None) -> None:
    """One flag per EngineConfig field (`only`: those fields), its default the field default. `multi_model`:
    `--model` repeats (`[NAME=]MODEL`; default None, the server serves the default model)."""
    overrides = {}
    if multi_model:
        overrides["model"] = dict(action="append", default=None, metavar="[NAME=]MODEL",
                                  help=f"model name (e.g. {DEFAULT_MODEL}), .gguf file or HF directory; repeat to "
                                       f"serve several (default: {DEFAULT_MODEL})")
    add_arguments(p, EngineConfig, only=only, overrides=overrides)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the flags `_engine_args` added."""
    kwargs = from_args(EngineConfig, args)
    kwargs["model"] = kwargs.get("model") or DEFAULT_MODEL
    return kwargs


def cmd_pull(args: argparse.Namespace) -> int:
    from pagedlm.hub.registry import pull
    print(pull(args.name))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedlm import LLM, SamplingParams
    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)  # --seed seeds the engine, which this request draws from
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    """The engine's KV sizing (kvcache/sizing.py) without loading the model: the weights are estimated from the
    checkpoint's tensors in the format the engine would hold them (model/plan.py `estimate_weight_bytes`;
    parameters x dtype for a bare config.json; a draft model's likewise, in its own quantization, with its KV cache
    beside the target's). A configuration this machine cannot hold is still reported (sized as if the
    available memory were unknown), with the engine's refusal."""
    from pagedlm.config import ModelConfig
    from pagedlm.engine.draft_loader import estimate_draft_sizing
    from pagedlm.hub.loader import load_hf_config
    from pagedlm.hub.registry import resolve_model
    from pagedlm.kvcache.kv_cache import KVCacheSpec
    from pagedlm.kvcache.plan import plan_kv_cache
    from pagedlm.kvcache.sizing import available_memory
    from pagedlm.model.plan import estimate_weight_bytes, plan_execution

    config = EngineConfig(**engine_kwargs(args))
    path = Path(config.model)
    if path.is_file() and path.suffix == ".json":
        hf, checkpoint = json.loads(path.read_text()), None
    else:
        checkpoint = resolve_model(config.model)
        hf = load_hf_config(checkpoint)
    cfg = ModelConfig.from_hf(hf)
    plan = plan_execution(config, checkpoint, measure=False)
    spec = KVCacheSpec.for_model(cfg, config.block_size, plan.dtype, plan.kv_cache_dtype)
    weights = (estimate_weight_bytes(checkpoint, plan) if checkpoint is not None
               else cfg.num_parameters() * plan.dtype.itemsize)
    report = plan_kv_cache(config, cfg, spec, weights, available_memory(), report_refusal=True,
                           draft=estimate_draft_sizing(config)).report
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("memory", help="KV cache arithmetic for a model or an HF config.json")
    _engine_args(p, only=MEMORY_FIELDS)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_memory)

    from pagedlm.bench.cli import add_bench_parser
    from pagedlm.chat_repl import add_chat_parser
    from pagedlm.router.cli import add_router_parser
    from pagedlm.server.cli import add_serve_parser
    from pagedlm.server.run_batch import add_run_batch_parser
    from pagedlm.server.top import add_top_parser

    add_serve_parser(sub, _engine_args, engine_kwargs)
    add_chat_parser(sub, _engine_args, engine_kwargs)
    add_run_batch_parser(sub, _engine_args, engine_kwargs)
    add_bench_parser(sub, _engine_args, engine_kwargs)
    add_router_parser(sub)
    add_top_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return args.fn(args)
    except BrokenPipeError:  # `pagedlm memory --json | head -1`: the reader left; no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError, argparse.ArgumentTypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
