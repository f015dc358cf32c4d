"""Model and engine configuration."""
from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
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
QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, see model/quant/
DEFAULT_MODEL = "smollm2-135m"  # what `pagedlm serve` and LLM() run without a model (a hub/registry.py name)
KERNEL_MAX_ROWS = 1 << 16  # kernel_max_rows at this value: every step runs the quantized kernels (no dense copy)
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.1  # the default KV budget's cap, of (available - weights): kvcache/sizing.py


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None,
           parse: Callable[[str], Any] | None = None, aliases: Sequence[str] = (), metavar: str | None = None,
           group: str | None = None) -> Any:
    """A config field that is also a command-line flag (see `add_arguments`): `--name-with-dashes`, plus
    `aliases`; `parse` turns the flag's text into the value (default: from the annotation)."""
    meta = dict(help=help, choices=tuple(choices) if choices is not None else None, parse=parse,
                aliases=tuple(aliases), metavar=metavar, group=group)
    return field(default=default, metadata=meta)


def byte_size(value: str) -> str:
    """A memory size flag (`2GiB`, `512MiB`, bytes), checked here and kept as written (parse_bytes reads it)."""
    try:
        parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


DTYPE_NAMES = ("auto", *DTYPES)


@dataclass
class EngineConfig:
    """Engine knobs, each a `pagedlm` flag of the same name (cli.py). Defaults follow vLLM where it has the knob."""

    model: str = option(DEFAULT_MODEL, f"model name (e.g. {DEFAULT_MODEL}), .gguf file or HF directory")
    dtype: str | torch.dtype = option("auto", "weights and activations (auto: bfloat16 where the hardware runs it "
                                      "natively, else float32)", choices=DTYPE_NAMES)
    device: str = option("cpu", "cpu | cuda")
    block_size: int = option(16, "tokens per KV cache block (a power of two)")
    kv_cache_memory: int | float | str | None = option(
        None, "KV cache budget, e.g. 2GiB (default: max_num_seqs sequences of max_model_len tokens, at most "
        "--kv-cache-memory-fraction of the memory the weights leave but one sequence where it fits; on CUDA 80%% "
        "of the free memory)", parse=byte_size)
    kv_cache_memory_fraction: float = option(DEFAULT_KV_CACHE_MEMORY_FRACTION, "share of the host memory "
                                             "available after the weights that the default KV budget may take")
    num_kv_blocks: int | None = option(None, "KV cache blocks (instead of --kv-cache-memory)")
    swap_space: int | float | str = option("1GiB", "host memory for swapped-out blocks (--preemption-mode swap)",
                                           parse=byte_size)
    max_model_len: int | None = option(None, "longest sequence, prompt and output (default: the model's context)")
    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int = option(2048, "most tokens in one step")
    enable_chunked_prefill: bool = option(True, "split prompts longer than the step's token budget over steps")
    preemption_mode: str = option("recompute", "what a preempted sequence gives up: its KV blocks (recompute) or "
                                  "their place on the device (swap)", choices=("recompute", "swap"))
    scheduling_policy: str = option("fcfs", "waiting requests start in arrival order (fcfs) or by request priority, "
                                    "lowest first (priority)", choices=("fcfs", "priority"))
    watermark: float = option(0.01, "share of the KV blocks new requests leave free for running ones")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes (off for models with "
                                         "sliding-window layers: their blocks are freed)")
    seed: int = option(0, "seed of the engine's sampling generator, which requests without their own seed draw from")
    attention_backend: str = option("auto", "auto | reference")
    quantization: str | None = option(None, "weight-only quantization of the linear layers: int8 (per channel) "
                                      "or int4 (group-wise)", choices=QUANTIZATION_METHODS, aliases=("-q",))
    quantization_group_size: int = option(32, "int4 group size (a multiple of 32)")
    kv_cache_dtype: str = option("auto", "KV cache element type (auto: the plan picks)", choices=KV_CACHE_DTYPES)
    kernel_max_rows: int | None = option(
        None, "quantized weights: steps of at most this many rows run the quantized kernels (and the fused decoder "
        "stack), larger ones a dense GEMM (default: measured once per CPU, model/probe.py)")
    # per-request limits (a request beyond them is refused with ValueError before anything is allocated)
    max_logprobs: int = option(20, "largest logprobs / prompt_logprobs / top_logprobs a request may ask for")
    max_stop_sequences: int = option(32, "most stop strings (and, separately, stop token ids) per request")
    max_stop_length: int = option(256, "longest stop string, in characters")

    def __post_init__(self) -> None:
        if self.quantization == "none":
            self.quantization = None
        check_choices(self)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.quantization == "int4" and (self.quantization_group_size < 32 or self.quantization_group_size % 32):
            raise ValueError(f"int4 quantization needs a group size that is a multiple of 32, "
                             f"got {self.quantization_group_size}.")
        if self.kernel_max_rows is not None and not 0 <= self.kernel_max_rows <= KERNEL_MAX_ROWS:
            raise ValueError(f"kernel_max_rows must be in [0, {KERNEL_MAX_ROWS}], got {self.kernel_max_rows}.")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        for name in ("kv_cache_memory", "swap_space"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name))
        for name in ("max_logprobs", "max_stop_sequences", "max_stop_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")


# --- config dataclasses as command-line flags ----------------------------------------------------------------------
def check_choices(config: Any) -> None:
    """ValueError unless every field with `choices` holds one of them (or None where None is the default)."""
    for f in fields(config):
        choices, value = f.metadata.get("choices"), getattr(config, f.name)
        if choices is None or value in choices or isinstance(value, torch.dtype):
            continue
        if value is None and f.default is None:
            continue
        raise ValueError(f"{f.name} must be one of {list(choices)}{' or None' if f.default is None else ''}, "
                         f"got {value!r}.")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None,
                  exclude: Sequence[str] = (), overrides: dict[str, dict[str, Any]] | None = None) -> None:
    """Add one flag per `option` field of the dataclass `cls` (`only` / `exclude` by field name): default the field
    default, bool fields as --flag / --no-flag, `list[...] | None` fields repeatable. `overrides[name]` replaces
    add_argument keywords of one flag. Fields with a `group` go into an argument group of that title."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in fields(cls):
        if (only is not None and f.name not in only) or f.name in exclude or "help" not in f.metadata:
            continue
        meta = f.metadata
        default = f.default
        kw: dict[str, Any] = dict(default=default, help=meta["help"], dest=f.name)
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        if kinds == [bool]:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kinds[0]) is list:
            kw.update(action="append", type=meta["parse"] or typing.get_args(kinds[0])[0])
        else:
            kw["type"] = meta["parse"] or (kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else str)
        if meta["choices"] is not None:
            kw["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kw["metavar"] = meta["metavar"]
        if default is not None and default is not False and default != "" and kw.get("action") != "append":
            kw["help"] += " (default: %(default)s)"
        kw.update((overrides or {}).get(f.name, {}))
        target = parser
        if meta["group"]:
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(meta["group"])
            target = groups[meta["group"]]
        target.add_argument(flag_name(f.name), *meta["aliases"], **kw)


def from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` that `args` holds, as keyword arguments."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


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
