"""A GGUF as an HF safetensors checkpoint (dequantized by transformers, saved in --dtype), for peers that load only
that form: vLLM-CPU's side of issue 30's batch comparisons runs the same model this way.

    ~/.cache/peers/vllm-cpu/bin/python benchmarks/gguf_to_hf.py ~/.cache/pagedlm/scale/random-1b-Q4_K_M.gguf \
        ~/.cache/peers/random-1b-hf

LLaMA-architecture files (the scale models of ../shared/tools/make-scale-model.py, SmolLM2). Kept free of pagedlm
imports: vLLM's venv has transformers and gguf, not pagedlm.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    name = args.gguf.name
    AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=name).save_pretrained(args.out)
    loaded = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=name, dtype=torch.float32,
                                                  quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    config = loaded.config
    config.quantization_config = None
    config.__dict__.pop("quantization_config", None)
    state = loaded.state_dict()
    del loaded
    with torch.device("meta"):  # the plain model takes the loaded tensors: one fp32 copy (a 3B's 13 GB), not two
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(state, strict=False, assign=True)
    del state
    plain.tie_weights()
    plain.to(getattr(torch, args.dtype)).save_pretrained(args.out)
    print(f"{args.gguf} -> {args.out} ({args.dtype})")


if __name__ == "__main__":
    main()
