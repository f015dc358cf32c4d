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
    # LLaMA-style families (model/llama.py): biases on q/k/v (Qwen2), on o_proj and on the MLP; QK-norm
    # ("head": an RMSNorm over each head's head_dim, Qwen3; "full": over the whole q and k projections, OLMoE),
    # OLMoE's clamp of q/k/v to +-clip_qkv.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    # Mixture of experts (num_experts 0: dense): each token's MLP output is the weighted sum of its top
    # num_experts_per_tok experts (softmax over all router logits, renormalized over the chosen ones when
    # norm_topk_prob), plus a shared expert behind a sigmoid gate where shared_expert_intermediate_size > 0
    # (Qwen2-MoE). moe_layers[i]: layer i has experts (else the dense MLP of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: list[bool] | None = None

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """The attention window of each layer (None: full attention)."""
        types = self.layer_types or ["full_attention"] * self.num_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers or [])

    @property
    def context_length(self) -> int:
        """The longest sequence the model serves: max_position_embeddings, stretched by linear, dynamic and YaRN
        RoPE scaling (as vLLM derives it; llama3 and longrope configs already state the stretched length)."""
        s = self.rope_scaling or {}
        kind, factor = s.get("rope_type"), s.get("factor") or 1.0
        if kind in ("linear", "dynamic"):
            return int(self.max_position_embeddings * factor)
        if kind == "yarn":
            return max(self.max_position_embeddings, int(s["original_max_position_embeddings"] * factor))
        return self.max_position_embeddings

    def num_parameters(self) -> int:
        """Parameters of the checkpoint (a tied LM head once, every expert of every MoE layer)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + self.qkv_bias * (q + 2 * kv) + self.o_bias * h
        attn += {"head": 2 * d, "full": q + kv}.get(self.qk_norm or "", 0)
        norms = 2 * h
        if self.model_type == "gemma3_text":
            attn, norms = attn + 2 * d, 4 * h

        def mlp(inter: int) -> int:
            return 3 * h * inter + self.mlp_bias * (2 * inter + h)

        moe = self.num_experts * (mlp(self.moe_intermediate_size) + h)
        if self.shared_expert_intermediate_size:
            moe += mlp(self.shared_expert_intermediate_size) + h
        flags = self.moe_layers or [False] * self.num_layers
        layers = sum(attn + norms + (moe if is_moe else mlp(self.intermediate_size)) for is_moe in flags)
        return layers + h + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type in ("gemma3", "gemma3_text"):
            return cls._from_hf_gemma3(cfg)
        if model_type not in LLAMA_STYLE_TYPES:
            arch = (cfg.get("architectures") or [None])[0]
            raise ValueError(f"Unsupported architecture {arch or model_type!r} (model_type {model_type!r}): pagedlm "
                             f"runs {', '.join(SUPPORTED_ARCHITECTURES)}.")
        return cls(**cls._common(cfg, model_type), **cls._llama_style(cfg, model_type))

    @staticmethod
    def _llama_style(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
        """What sets the LLaMA-style families apart, read as transformers' config classes read it."""
        n = cfg["num_hidden_layers"]
        rope = cfg.get("rope_parameters") or {}
        if (cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"{model_type}: partial rotary embeddings (partial_rotary_factor < 1) are not supported.")
        out: dict[str, Any] = dict(hidden_act=cfg.get("hidden_act") or "silu")
        window = cfg.get("sliding_window") or None
        types = cfg.get("layer_types")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
            window = None
        if window is not None:
            if not types:
                mwl = cfg.get("max_window_layers", n)
                sliding = {"qwen2": lambda i: i >= mwl, "qwen3": lambda i: i >= mwl,
                           "qwen2_moe": lambda i: (i + 1) % 2 == 1 and i < mwl}.get(model_type, lambda i: True)
                types = ["sliding_attention" if sliding(i) else "full_attention" for i in range(n)]
            out.update(layer_types=list(types), sliding_window=int(window))
        if model_type in ("qwen2", "qwen2_moe"):
            out["qkv_bias"] = cfg.get("qkv_bias", True)
        else:
            bias = bool(cfg.get("attention_bias", False))
            out.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
        if model_type in ("qwen3", "qwen3_moe"):
            out["qk_norm"] = "head"
        elif model_type == "olmoe":
            out.update(qk_norm="full", clip_qkv=cfg.get("clip_qkv"))
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe") and experts:
            step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
            out.update(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                       moe_intermediate_size=(cfg.get("moe_intermediate_size") if model_type.startswith("qwen")
                                              else None) or cfg["intermediate_size"],
                       norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
                       shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
                       moe_layers=[i not in dense and (i + 1) % step == 0 for i in range(n)])
        return out

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
            rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0,
            rope_scaling=_rope_scaling(cfg),
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


LLAMA_STYLE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SUPPORTED_ARCHITECTURES = ("LLaMA", "Mistral", "Qwen2/2.5", "Qwen3", "Phi-3", "Mixtral", "Qwen2-MoE", "Qwen3-MoE",
                           "OLMoE", "Gemma 3")


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling of an HF config (`rope_scaling`, or transformers 5's flat `rope_parameters`) as one dict
    with `rope_type` and, for the types that need it, `original_max_position_embeddings` (for dynamic NTK: the
    length beyond which it scales, max_position_embeddings) and `factor`; None for plain RoPE."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if scaling is None and ("rope_type" in rope or "type" in rope):
        scaling = rope
    if not scaling:
        return None
    s = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    kind = scaling.get("rope_type") or scaling.get("type")
    kind = "longrope" if kind == "su" else kind  # older Phi-3 configs
    if kind in (None, "default"):
        return None
    max_pos = cfg.get("max_position_embeddings") or 2048
    s["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope"):  # Phi-3 states the pretraining length at the top level
        s["original_max_position_embeddings"] = (cfg.get("original_max_position_embeddings")
                                                 or s.get("original_max_position_embeddings") or max_pos)
    elif kind == "dynamic":
        s["original_max_position_embeddings"] = max_pos
    if kind in ("yarn", "longrope") and s.get("factor") is None:
        s["factor"] = max_pos / s["original_max_position_embeddings"]
    return s


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8_e4m3")
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
    kv_cache_dtype: str = "auto"  # "auto" (the plan picks) | "float32" | "bfloat16" | "int8" | "fp8_e4m3"
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
