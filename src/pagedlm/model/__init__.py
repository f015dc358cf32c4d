"""Model families and loaders."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedlm.config import KERNEL_MAX_ROWS, ModelConfig

if TYPE_CHECKING:
    from pagedlm.model.base import CausalLM


def load_model(path: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None,
               group_size: int = 32, dense_dtype: torch.dtype | None = None,
               kernel_max_rows: int = KERNEL_MAX_ROWS,
               head_kernel_max_rows: int | None = None,
               fallback: str | None = None, dense_copy: bool = True,
               native: bool = False, weight_cache_dir: Path | None = None,
               weight_cache_budget: int | None = None, huge_pages: bool = True) -> tuple[CausalLM, ModelConfig]:
    """Build the model for the checkpoint at `path` (.gguf file or HF directory) and load its weights, then
    quantize its linear layers (`quantization`: None | "int8" | "int4"; products with more than `kernel_max_rows`
    rows through a dense copy in `dense_dtype` (per call without `dense_copy`), see model/quant/ and plan.py;
    `head_kernel_max_rows` for the int8 embedding table as LM head, None: the same; `fallback`: the method for the
    linear weights a GGUF holds no native blocks for, None: `quantization`; `native`: keep every GGUF block kind a
    kernel runs as stored, the plan's default for a GGUF). Weights stream from the checkpoint into
    their final format one tensor at a time: the model is built without weights (`layers.deferred_weights`) and
    each Linear is quantized as soon as it is loaded, so loading never holds more than the result plus one tensor's
    temporaries. With `weight_cache_dir`, a GGUF's converted layouts are mapped from the repacked-weight cache
    there where it holds them, and written there at the end of a load that converted anything (weight_cache.py; the
    files there within `weight_cache_budget` bytes, None: half the disk space free for them);
    `model.weight_cache` then says what was mapped and converted. With `huge_pages` (where the OS has them), the
    weights live in 2 MiB pages (huge_pages.py): converted ones in an arena, cached ones mapped so."""
    from pagedlm.hub.loader import iter_weights, load_hf_config, open_gguf
    from pagedlm.model import weight_cache
    from pagedlm.model.gemma3 import Gemma3ForCausalLM
    from pagedlm.model.huge_pages import HugePageArena
    from pagedlm.model.huge_pages import available as huge_pages_available
    from pagedlm.model.layers import Linear, deferred_weights
    from pagedlm.model.llama import LlamaForCausalLM
    from pagedlm.model.plan import NATIVE_INT4_TYPES, NATIVE_TYPES
    from pagedlm.model.quantize import LinearQuantizer

    cfg = ModelConfig.from_hf(load_hf_config(path))
    model_cls = Gemma3ForCausalLM if cfg.model_type == "gemma3_text" else LlamaForCausalLM  # + every LLaMA style
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), deferred_weights():
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    # the GGUF blocks kept as stored: every kind a kernel runs under the default plan (`native`, the vocabulary
    # tables included), the int4 kinds under an explicit int4
    native = () if quantization != "int4" or group_size != 32 else NATIVE_TYPES if native else NATIVE_INT4_TYPES
    quantizer = LinearQuantizer(model, quantization, group_size, fallback, native) if quantization else None
    # the vocabulary matrices become int8 (bf16) tables: read them by rows, never whole in fp32
    lazy = ("model.embed_tokens.weight", "lm_head.weight") if quantization and device.type == "cpu" else ()
    cache = None
    if weight_cache_dir is not None and quantization and device.type == "cpu" and Path(path).is_file():
        cache = weight_cache.WeightCache.open(weight_cache_dir, Path(path), open_gguf(path), weight_cache_budget,
                                              huge_pages)
    arena = HugePageArena() if huge_pages and quantization and device.type == "cpu" and huge_pages_available() else None
    with weight_cache.active(cache, arena):
        model.load_weights(iter_weights(path, dtype, native, lazy), quantizer, device)
        if quantizer is not None:
            quantizer.finish(dense_dtype, kernel_max_rows, head_kernel_max_rows, dense_copy)
    model.weight_cache = cache.stats if cache is not None else None
    model.process_weights_after_loading()
    if dtype == torch.bfloat16 and device.type == "cpu":
        from pagedlm.cpu import cpu_features

        if cpu_features().native_bf16:  # the remaining bf16 Linears, prepacked for oneDNN
            for m in model.modules():
                if isinstance(m, Linear):
                    m.pack_bf16()
    return model.eval(), cfg
