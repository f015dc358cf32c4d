"""The engine's configuration: `EngineConfig`, one field per `pagedlm` engine flag."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.config.flags import check_choices, option
from pagedlm.config.speculative import SpeculativeConfig, parse_speculative_config
from pagedlm.config.units import DTYPE_NAMES, byte_size, parse_bytes

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, see model/quant/
DEFAULT_MODEL = "smollm2-135m"  # what `pagedlm serve` and LLM() run without a model (a hub/registry.py name)
KERNEL_MAX_ROWS = 1 << 16  # kernel_max_rows at this value: every step runs the quantized kernels (no dense copy)
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.1  # the default KV budget's cap, of (available - weights): kvcache/sizing.py


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
    kv_cache_dir: str | None = option(None, "directory of the prefix cache's disk tier: full KV blocks are written "
                                      "there and found again after a restart or by another engine sharing it "
                                      "(default: no disk tier)")
    kv_disk_budget: int | float | str = option("20GiB", "most bytes the files under --kv-cache-dir may take "
                                               "(least recently used go first)", parse=byte_size)
    kv_disk_write_share: float = option(0.01, "share of one core's time the disk tier's writes may take, over a "
                                        "burst of 5 minutes (blocks beyond it stay in memory only; 1: no limit)")
    seed: int = option(0, "seed of the engine's sampling generator, which requests without their own seed draw from")
    attention_backend: str = option("auto", "auto | reference")
    quantization: str | None = option(None, "weight-only quantization of the linear layers: int8 (per channel) "
                                      "or int4 (group-wise)", choices=QUANTIZATION_METHODS, aliases=("-q",))
    quantization_group_size: int = option(32, "int4 group size (a multiple of 32)")
    kv_cache_dtype: str = option("auto", "KV cache element type (auto: the plan picks)", choices=KV_CACHE_DTYPES)
    kernel_max_rows: int | None = option(
        None, "quantized weights: steps of at most this many rows run the quantized kernels (and the fused decoder "
        "stack), larger ones a dense GEMM (default: measured once per CPU, model/probe.py)")
    speculative_config: SpeculativeConfig | dict | str | None = option(
        "auto", 'speculative decoding: auto (greedy requests draft by prompt lookup), off, or vLLM\'s JSON shape: '
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or '
        '\'{"method": "draft_model", "model": "NAME", "num_speculative_tokens": 4}\' (docs/speculative.md; requests '
        'with a `prediction` speculate whatever this is)', metavar="auto|off|JSON",
        parse=parse_speculative_config)
    weight_cache: str = option("auto", "where a GGUF's repacked weights are cached, so that a second start maps "
                               "them instead of converting them again: auto (<cache root>/weights/<uid>), a "
                               "directory, or off (docs/models.md)", metavar="auto|off|DIR")
    weight_cache_budget: str = option("auto", "most disk the repacked-weight cache may take (least recently used "
                                      "files go first): auto (half the disk space free for it) or a size such as "
                                      "20GiB", metavar="auto|SIZE")
    huge_pages: bool = option(True, "keep the quantized weights in 2 MiB pages (Linux transparent huge pages, "
                              "madvise): the decode steps' weight streams read faster than from 4 KiB pages")
    # per-request limits (a request beyond them is refused with ValueError before anything is allocated)
    max_logprobs: int = option(20, "largest logprobs / prompt_logprobs / top_logprobs a request may ask for")
    max_stop_sequences: int = option(32, "most stop strings (and, separately, stop token ids) per request")
    max_stop_length: int = option(256, "longest stop string, in characters")

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.quantization == "none":
            self.quantization = None
        check_choices(self)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}.")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
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
        if not str(self.weight_cache).strip():
            raise ValueError("weight_cache must be auto, off or a directory, got an empty string.")
        if self.weight_cache_budget != "auto" and parse_bytes(self.weight_cache_budget) <= 0:
            raise ValueError(f"weight_cache_budget must be auto or a positive size, got {self.weight_cache_budget!r}.")
        if self.kv_cache_dir is not None and not str(self.kv_cache_dir).strip():
            raise ValueError("kv_cache_dir must be a directory path, got an empty string.")
        if not self.kv_disk_write_share > 0:
            raise ValueError(f"kv_disk_write_share must be positive, got {self.kv_disk_write_share!r}.")
        if parse_bytes(self.kv_disk_budget) <= 0:
            raise ValueError(f"kv_disk_budget must be positive, got {self.kv_disk_budget!r}.")
        for name in ("kv_cache_memory", "swap_space"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name))
        for name in ("max_logprobs", "max_stop_sequences", "max_stop_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
