"""The engines the offline benchmarks compare, behind one interface: `generate(prompts, max_tokens)` runs
every prompt (token ids) greedily to exactly `max_tokens` new tokens and returns how many were generated.

- `pagedlm`: this engine (continuous batching over the paged KV cache).
- `hf`: transformers' `generate` with static batching (prompts have equal length, so no padding).
- `llama.cpp`: llama-cpp-python (optional extra `pip install llama-cpp-python`, compiles for minutes),
  one request at a time through its high-level API, `n_threads` = torch's thread count.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch


class Backend(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int: ...


class PagedlmBackend:
    name = "pagedlm"

    def __init__(self, model: str, dtype: str, **engine_kwargs) -> None:
        from pagedlm import LLM
        self.llm = LLM(model=model, dtype=dtype, **engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = self.llm.engine.model_config.vocab_size

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        from pagedlm import SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)


class HFBackend:
    name = "hf"

    def __init__(self, path: Path, dtype: torch.dtype, max_batch: int = 64) -> None:
        from transformers import AutoModelForCausalLM
        path = Path(path)
        if path.is_dir():
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:  # a GGUF file: transformers dequantizes it
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        self.model.eval()
        self.max_batch = max_batch
        cfg = self.model.generation_config
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else 0
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        total = 0
        for i in range(0, len(prompts), self.max_batch):
            ids = torch.tensor(prompts[i:i + self.max_batch])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad)
            total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return total


class LlamaCppBackend:
    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int = 0) -> None:  # 0: the model's own context length
        import llama_cpp  # optional extra
        if Path(path).is_dir():
            raise ValueError("the llama.cpp backend needs a .gguf model")
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, verbose=False,
                                   n_threads=torch.get_num_threads(), logits_all=False)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        total = 0
        for p in prompts:
            self.llm.reset()
            for n, _ in enumerate(self.llm.generate(p, temp=0.0, top_k=1, reset=True), start=1):
                if n >= max_tokens:  # greedy, eos ignored: stop after exactly max_tokens
                    break
            total += n
        return total


def make_backend(name: str, model: str, dtype: str, engine_kwargs: dict) -> Backend:
    """The engine `name` for `model`. A load timed around this call times each engine's own work: llama.cpp's is
    `import llama_cpp` and `Llama(path)` for a .gguf path (pagedlm's imports and GGUF check are not in it)."""
    if name == "pagedlm":
        return PagedlmBackend(model, dtype, **engine_kwargs)
    if name in ("llama.cpp", "llamacpp") and str(model).endswith(".gguf") and Path(model).is_file():
        return LlamaCppBackend(Path(model))
    from pagedlm.config import parse_dtype
    from pagedlm.hub.registry import resolve_model
    path = resolve_model(model)
    if name == "hf":
        return HFBackend(path, parse_dtype(dtype))
    if name in ("llama.cpp", "llamacpp"):
        return LlamaCppBackend(path)
    raise ValueError(f"unknown backend {name!r} (pagedlm, hf, llama.cpp)")


def threads_note() -> str:
    return f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
