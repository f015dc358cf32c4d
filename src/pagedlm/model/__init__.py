"""Model families and loaders."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pagedlm.config import ModelConfig


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, ModelConfig]:
    """Build the model for the checkpoint at `path` (.gguf file or HF directory) and load its weights."""
    from pagedlm.model.gemma3 import Gemma3ForCausalLM
    from pagedlm.model.llama import LlamaForCausalLM
    from pagedlm.model.loader import iter_weights, load_hf_config

    cfg = ModelConfig.from_hf(load_hf_config(path))
    model_cls = Gemma3ForCausalLM if cfg.model_type == "gemma3_text" else LlamaForCausalLM
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(iter_weights(path, dtype))
    return model.eval(), cfg
