"""Configuration, typed end to end: `EngineConfig` (engine.py), `ModelConfig` and each family's HF translation
(model.py, hf.py), an engine loop's serving settings (loop.py: `LoopConfig`), replicas (parallel.py:
`ParallelConfig`), routing (router.py: `RouterConfig`), the flag machinery (flags.py: a config field is a
command-line flag) and units (units.py)."""
from pagedlm.config.engine import (
    DEFAULT_KV_CACHE_MEMORY_FRACTION,
    DEFAULT_MODEL,
    KERNEL_MAX_ROWS,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    EngineConfig,
)
from pagedlm.config.flags import add_arguments, check_choices, flag_name, from_args, option
from pagedlm.config.hf import LLAMA_STYLE_TYPES, SUPPORTED_ARCHITECTURES
from pagedlm.config.loop import LoopConfig
from pagedlm.config.model import ModelConfig
from pagedlm.config.parallel import ParallelConfig
from pagedlm.config.router import RouterConfig
from pagedlm.config.speculative import SpeculativeConfig
from pagedlm.config.units import DTYPE_NAMES, DTYPES, byte_size, default_dtype, parse_bytes, parse_dtype

__all__ = [
    "DEFAULT_KV_CACHE_MEMORY_FRACTION", "DEFAULT_MODEL", "DTYPES", "DTYPE_NAMES", "KERNEL_MAX_ROWS", "KV_CACHE_DTYPES",
    "LLAMA_STYLE_TYPES", "QUANTIZATION_METHODS", "SUPPORTED_ARCHITECTURES", "EngineConfig", "LoopConfig", "ModelConfig",
    "ParallelConfig", "RouterConfig", "SpeculativeConfig", "add_arguments", "byte_size", "check_choices",
    "default_dtype", "flag_name", "from_args", "option", "parse_bytes", "parse_dtype",
]
