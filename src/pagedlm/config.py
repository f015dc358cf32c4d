"""Model and engine configuration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}.")
    return DTYPES[dtype]


def default_dtype() -> torch.dtype:
    """bf16 where the hardware runs it natively (CUDA, CPUs with AVX512-BF16/AMX), else fp32."""
    if torch.cuda.is_available():
        return torch.bfloat16
    from pagedlm.cpu import cpu_features

    return torch.bfloat16 if cpu_features().native_bf16 else torch.float32


@dataclass
class ModelConfig:
    """The architecture facts the runtime needs, read from an HF-style config dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    # Gemma 3 (None / defaults for LLaMA): per-layer "sliding_attention" | "full_attention", the window
    # (a key at position p is visible from query q iff q - window < p <= q), RoPE base of sliding layers,
    # attention scale query_pre_attn_scalar ** -0.5, tanh soft-capping, embeddings times embedding_scale.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embedding_scale: float | None = None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """The attention window of each layer (None: full attention)."""
        types = self.layer_types or ["full_attention"] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type in ("gemma3", "gemma3_text"):
            return cls._from_hf_gemma3(cfg)
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"Unsupported model_type {model_type!r}: pagedlm runs LLaMA-family and Gemma 3 models.")
        return cls(**cls._common(cfg, model_type))

    @staticmethod
    def _common(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def _from_hf_gemma3(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Gemma3TextConfig semantics, its defaults included (a GGUF carries only some of these keys)."""
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if not types:
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        rope = cfg.get("rope_parameters") or {}
        local = (rope.get("sliding_attention") or {}).get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
        glob = (rope.get("full_attention") or {}).get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0
        common = cls._common({**cfg, "rope_theta": glob, "head_dim": cfg.get("head_dim") or 256,
                              "rms_norm_eps": cfg.get("rms_norm_eps") or 1e-6,
                              "max_position_embeddings": cfg.get("max_position_embeddings") or 131072,
                              "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}, "gemma3_text")
        if (common.pop("rope_scaling") or {}).get("rope_type", "default") != "default":
            raise ValueError("Gemma 3 with rope scaling is not supported.")
        return cls(**common, rope_scaling=None,
                   hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
                   layer_types=list(types), sliding_window=cfg.get("sliding_window") or 4096,
                   rope_local_base_freq=float(local),
                   query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") or 256,
                   attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
                   final_logit_softcapping=cfg.get("final_logit_softcapping"),
                   embedding_scale=cfg["hidden_size"] ** 0.5)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, see model/quant.py
KERNEL_MAX_ROWS = 16  # the most rows the quantized kernels and the fused decoder stack take


@dataclass
class EngineConfig:
    """Engine knobs. Defaults follow vLLM where it has the same knob."""

    model: str = "smollm2-135m"
    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int | float | str | None = None  # bytes, or "2GiB"; None -> default budget
    num_kv_blocks: int | None = None
    swap_space: int | float | str = "1GiB"  # host memory for swapped-out blocks
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    scheduling_policy: str = "fcfs"  # or "priority"
    watermark: float = 0.01
    enable_prefix_caching: bool = True  # off for models with sliding-window layers (their blocks are freed)
    seed: int = 0
    attention_backend: str = "auto"  # "reference" | "auto"
    quantization: str | None = None  # weight-only: "int8" (per channel) | "int4" (group-wise)
    quantization_group_size: int = 32
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "int8" | "fp8_e4m3"
    # Quantized weights: steps of at most this many rows run the quantized kernels (and the fused decoder stack),
    # larger ones a dense GEMM. None: measured at start-up (model/probe.py, cached per CPU).
    kernel_max_rows: int | None = None
    # per-request limits (a request beyond them is refused with ValueError before anything is allocated)
    max_logprobs: int = 20  # logprobs / prompt_logprobs (vLLM's default)
    max_stop_sequences: int = 32  # stop strings, and stop token ids, each
    max_stop_length: int = 256  # characters per stop string

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.quantization not in (None, "none", *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be 'int8', 'int4' or None, got {self.quantization!r}.")
        if self.quantization == "none":
            self.quantization = None
        if self.quantization == "int4" and (self.quantization_group_size < 32 or self.quantization_group_size % 32):
            raise ValueError(f"int4 quantization needs a group size that is a multiple of 32, "
                             f"got {self.quantization_group_size}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}.")
        if self.kernel_max_rows is not None and not 0 <= self.kernel_max_rows <= KERNEL_MAX_ROWS:
            raise ValueError(f"kernel_max_rows must be in [0, {KERNEL_MAX_ROWS}], got {self.kernel_max_rows}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        for name in ("max_logprobs", "max_stop_sequences", "max_stop_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | float | str) -> int:
    """`2GiB`, `512MiB`, `1e9` or a plain number of bytes. Plain numbers below 1024 are GiB (vLLM style)."""
    if isinstance(value, (int, float)):
        return int(value * 2**30) if value < 1024 else int(value)
    s = value.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"Cannot parse a memory size from {value!r} (use e.g. '2GiB', '512MiB' or bytes).")
    n = float(num)
    return int(n * 2**30) if unit == "" and n < 1024 else int(n * _UNITS[unit])
