"""Model families and loaders."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagedlm.config import ModelConfig


def load_model(path: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None,
               group_size: int = 32) -> tuple[nn.Module, ModelConfig]:
    """Build the model for the checkpoint at `path` (.gguf file or HF directory) and load its weights, then
    quantize its linear layers (`quantization`: None | "int8" | "int4", see model/quant.py)."""
    from pagedlm.model.gemma3 import Gemma3ForCausalLM
    from pagedlm.model.llama import LlamaForCausalLM
    from pagedlm.model.loader import iter_weights, load_hf_config

    cfg = ModelConfig.from_hf(load_hf_config(path))
    model_cls = Gemma3ForCausalLM if cfg.model_type == "gemma3_text" else LlamaForCausalLM  # + every LLaMA style
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(iter_weights(path, dtype))
    if quantization:
        from pagedlm.model.quant import quantize_model
        quantize_model(model, quantization, group_size)
    return model.eval(), cfg
