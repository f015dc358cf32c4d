"""How a checkpoint runs on this machine: the activation dtype, the weight format of the linear layers, and which
matmul path serves a step of a given size. Decided once at start-up from the CPU's features, the checkpoint and the
user's settings; `ExecutionPlan.describe()` says what was chosen and why.

The default (`dtype="auto"`, no `quantization`) on a CPU:
- a GGUF whose linear weights are Q2_K / Q3_K / Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_K / Q6_K / Q8_0 / IQ4_NL / IQ4_XS blocks
  runs them as the file stores them, each kind in a kernel of its own (model/quant/: int4.py, gguf.py; no weight is
  rounded a second time and decode reads about the file's bytes), with fp32 activations, so decode steps take the
  fused C++ decoder stack, and a 2-byte KV cache (unless `kv_cache_dtype` says otherwise): half the bytes of fp32,
  so twice the tokens fit; bf16 where AVX512-BF16 reads it in place, else fp16 (`default_kv_cache_dtype`: converted
  to fp32 as fast as bf16 and 8x finer; against an fp32 cache, fp32 weights, perplexity +0.16% for bf16 and -0.02%
  for fp16 on Gemma 3);
- a fused q/k/v or gate/up whose parts mix kinds (Q4_K_M's Q6_K v beside Q4_K q and k; Gemma 3's Q8_0 v beside
  Q5_0 q and k) runs part by part, each in its own kernel (`ConcatLinear`); a weight that has no such kernel (another
  block type) is requantized to int8 per channel (8 bits: at least as many as any of those formats holds), said at
  start-up;
- an HF checkpoint on a CPU with AVX512-BF16 keeps its weights in bf16 (a bf16 checkpoint's as stored; others
  rounded) and runs fp32 activations through the bf16 kernels of model/quant/ (`Bf16Linear`: activations rounded
  to bf16 at each product, as a bf16 GEMM does, but the residual stream, norms and attention in fp32), so decode
  steps take the fused decoder stack too, with a bf16 KV cache;
- anything else runs in bf16 where the CPU has native bf16 (AVX512-BF16 or AMX), else in fp32, as before.
Steps with more rows than `kernel_max_rows`, where a GEMM beats the quantized kernels, run a GEMM over the weights
dequantized (bf16 where the CPU has native bf16 and the dtype was left to `auto`, else fp32): over a dense copy kept
beside the quantized weights where that copy takes at most DENSE_COPY_MEMORY_FRACTION of the machine's memory (small
models), else over each weight dequantized per call into one shared scratch buffer, so that a model's footprint stays
near its file size (`ExecutionPlan.dense_copy`). The crossover is measured by model/probe.py for that path (cached per
CPU) unless `kernel_max_rows` is set. On CPUs with AMX-INT8 the int4 / int8 / Q8_0 kernels run products of many rows
on AMX tiles with the AVX-512 VNNI kernels' exact results (csrc/amx_x16.h), which moves that crossover up.
An explicit `dtype` keeps its meaning: `dtype="float32"` without `quantization` is the full-precision path.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedlm.config import KERNEL_MAX_ROWS, EngineConfig, parse_dtype
from pagedlm.cpu import cpu_features

# GGUF block formats model/quant/ runs as stored: int4 (int4.py) and 5- to 8-bit (gguf.py).
NATIVE_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
NATIVE_TYPES = (*NATIVE_INT4_TYPES, "Q2_K", "Q3_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS")
UNQUANTIZED_TYPES = ("F32", "F16", "BF16")
DENSE_COPY_MEMORY_FRACTION = 1 / 32  # the most of the machine's memory a dense copy of the weights may take


@dataclass
class ExecutionPlan:
    dtype: torch.dtype  # activations (and the KV cache unless kv_cache_dtype says otherwise)
    quantization: str | None  # weight format of the linear layers: None | "int8" | "int4" | "bf16"
    group_size: int
    dense_dtype: torch.dtype | None  # the quantized layers' dense copy for big steps (None: not quantized)
    kernel_max_rows: int  # steps of at most this many rows run the quantized kernels / the fused decoder stack
    reasons: list[str] = field(default_factory=list)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype, resolved ("auto": the activations' dtype)
    head_kernel_max_rows: int | None = None  # the same for the embedding table as LM head (None: as above)
    fallback: str | None = None  # "int8": linear weights the checkpoint holds no native blocks for (None: quantization)
    dense_copy: bool = True  # big steps over a dense copy of the weights (else dequantized per call)
    native_types: tuple[str, ...] = ()  # GGUF block types the layers keep as stored

    def describe(self) -> str:
        weights = {None: "dense", "int8": "int8 per channel", "int4": f"int4 (groups of {self.group_size})",
                   "bf16": "bf16"}[self.quantization]
        if self.native_types:
            weights = f"the checkpoint's own {'/'.join(self.native_types)} blocks"
        if self.fallback:
            weights += ", any other linear weight int8 per channel"
        kv = _name(self.dtype) if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        s = f"execution: activations {_name(self.dtype)}, weights {weights}, KV cache {kv}"
        if self.quantization and self.kernel_max_rows >= KERNEL_MAX_ROWS:
            s += "; every step runs the quantized kernels (no dense copy)"
        elif self.quantization:
            over = "a dense copy" if self.dense_copy else "the weights dequantized per call"
            s += (f"; steps of <= {self.kernel_max_rows} rows run the quantized kernels, larger ones a "
                  f"{_name(self.dense_dtype)} GEMM over {over}")
            if self.head_kernel_max_rows is not None:
                s += f" (the LM head's kernel: <= {self.head_kernel_max_rows} rows)"
        return s + "; " + "; ".join(self.reasons)


def _amx() -> bool:
    from pagedlm.model.quant.kernel import amx_native

    return amx_native()


def _name(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def gguf_linear_types(path: Path) -> set[str]:
    """The GGUF block types of a checkpoint's per-layer linear weights (empty for HF directories); MoE routers
    (ffn_gate_inp*) are left out: they stay in their stored precision (model/moe.py)."""
    path = Path(path)
    if path.is_dir():
        return set()
    from pagedlm.hub.loader import open_gguf

    return {t.tensor_type.name for t in open_gguf(path).tensors  # matrices, and stacks of experts' matrices
            if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) in (2, 3)
            and ".ffn_gate_inp" not in t.name}


def mixed_fused_types(path: Path) -> set[str]:
    """The GGUF block types of the q/k/v or gate/up groups whose parts differ in type (they fuse into one weight
    that runs part by part), unless one int4 layout holds them all (Q4_0 with Q4_1)."""
    from pagedlm.hub.loader import open_gguf

    groups: dict[tuple[str, str], set[str]] = {}
    for t in open_gguf(Path(path)).tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
            fused = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up",
                     "ffn_gate_exps": "gate_up_exps", "ffn_up_exps": "gate_up_exps"}
            if parts[2] in fused:
                groups.setdefault((parts[1], fused[parts[2]]), set()).add(t.tensor_type.name)
    return {k for g in groups.values() if len(g) > 1 and not g <= {"Q4_0", "Q4_1"} for k in g}


def machine_memory() -> int:
    """Bytes of physical memory, or what this process's cgroup leaves it where that is less (kvcache.sizing reads
    the cgroup, v1 or v2, as it does for the KV budget)."""
    from pagedlm.kvcache.sizing import available_memory

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mem = available_memory()
    return min(total, mem.bytes) if mem.bytes and mem.source.startswith("cgroup") else total


def dense_weight_bytes(path: Path, dtype: torch.dtype) -> int:
    """About the bytes a dense copy in `dtype` of a checkpoint's matrices takes (GGUF: from its tensors' shapes; HF:
    from the size of its safetensors files and stored dtype)."""
    path = Path(path)
    size = torch.empty(0, dtype=dtype).element_size()
    if path.is_dir():
        from pagedlm.hub.loader import load_hf_config

        stored = parse_dtype(load_hf_config(path).get("torch_dtype", "float32"))
        files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return files // torch.empty(0, dtype=stored).element_size() * size
    from pagedlm.hub.loader import open_gguf

    return sum(t.n_elements for t in open_gguf(path).tensors if len(t.shape) in (2, 3)) * size


TABLES = ("token_embd.weight", "model.embed_tokens.weight")  # the embedding table, GGUF's name and HF's
HEADS = ("output.weight", "lm_head.weight")


def checkpoint_tensors(path: Path) -> list[tuple[str, tuple[int, ...], str | None, int]]:
    """Each tensor of a checkpoint as (name, shape, GGUF block type or None, bytes stored), from its header."""
    path = Path(path)
    if path.is_file():
        from pagedlm.hub.loader import open_gguf

        return [(t.name, tuple(reversed(t.shape)), t.tensor_type.name, t.data.nbytes) for t in open_gguf(path).tensors]
    from safetensors import SafetensorError, safe_open

    from pagedlm.hub.registry import ModelLoadError

    out = []
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(f, "pt") as st:
                out += [(name, tuple(st.get_slice(name).get_shape()), None, 0) for name in st.keys()]
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    return out


def estimate_weight_bytes(path: Path, plan: ExecutionPlan) -> int:
    """About the bytes of a checkpoint's weights as `plan` holds them once loaded (`ModelRunner.weight_bytes`),
    from the tensors' shapes and block types, without loading them (`pagedlm memory`): GGUF blocks a kernel runs
    as stored, other linear weights in the plan's format (int4: half a byte and an fp16 scale and minimum per group;
    int8: a byte and an fp32 scale per row; bf16), the embedding table int8 per row (bf16 for bf16; as stored where
    a kernel runs it) and shared by a tied LM head, the rest in the activations' dtype. The dense copies for big
    steps are not weights here either."""
    from pagedlm.model.quant.gguf import GGUF_KINDS, layout_bytes

    q, dense = plan.quantization, torch.empty(0, dtype=plan.dtype).element_size()
    native = set(NATIVE_TYPES if plan.native_types else NATIVE_INT4_TYPES) \
        if q == "int4" and plan.group_size == 32 and Path(path).is_file() else set()
    tensors = checkpoint_tensors(path)
    tied = not any(name in HEADS for name, *_ in tensors)
    total = 0
    for name, shape, kind, stored in tensors:
        n = math.prod(shape)
        table = name in TABLES
        if q is None or len(shape) not in (2, 3):  # 3: a stack of experts' matrices
            total += n * dense * (2 if table and tied and q is None else 1)  # unquantized, a tied head is a copy
        elif kind in native:
            total += layout_bytes(kind, n // shape[-1], shape[-1]) if kind in GGUF_KINDS else stored
        elif q == "bf16":
            total += 2 * n
        elif table or (plan.fallback or q) == "int8":
            total += n + 4 * (n // shape[-1])
        else:
            total += n // 2 + 4 * n // plan.group_size
    return total


def default_kv_cache_dtype(cpu_flags: frozenset[str]) -> str:
    """The 2-byte KV cache of the CPU default plans: bf16 where AVX512-BF16 reads it in place (attention's
    vdpbf16ps loops), else fp16 (F16C converts it as fast as bf16 converts, and fp16 keeps 10 mantissa bits to
    bf16's 7: per-token log-probabilities move ~9x less against an fp32 cache)."""
    return "bfloat16" if "avx512_bf16" in cpu_flags else "float16"


def plan_execution(config: EngineConfig, path: Path | None, measure: bool = True) -> ExecutionPlan:
    """Resolve `dtype="auto"` and the weight format for the checkpoint at `path` (None: a bare config) on
    `config.device`. Without `measure`, kernel_max_rows is not probed (the dtype and format are the same)."""
    cpu = cpu_features()
    on_cpu = torch.device(config.device).type == "cpu"
    reasons: list[str] = [f"CPU flags: {cpu.describe()}"] if on_cpu else []
    quantization, group_size = config.quantization, config.quantization_group_size
    fallback, native = None, ()
    auto = config.dtype == "auto"
    if auto and quantization is None and on_cpu and path is not None and Path(path).is_dir():
        if {"avx512_bf16", "avx512_vnni"} <= cpu.flags:
            from pagedlm.hub.loader import load_hf_config

            stored = load_hf_config(Path(path)).get("torch_dtype", "float32")
            quantization = "bf16"
            reasons.append(f"bf16 weights ({'as stored' if stored == 'bfloat16' else f'rounded from {stored}'}) "
                           "with fp32 activations: the CPU has AVX512-BF16")
    elif auto and quantization is None and on_cpu and path is not None:
        types = gguf_linear_types(path)
        native, other = tuple(t for t in NATIVE_TYPES if t in types), types - set(NATIVE_TYPES)
        if native:
            quantization, group_size = "int4", 32
            reasons.append(f"the checkpoint's {'/'.join(native)} blocks run as stored, each kind in a kernel of its "
                           "own")
            fallback = "int8" if types - set(NATIVE_INT4_TYPES) else None
            if mixed := mixed_fused_types(path):
                reasons.append(f"fused q/k/v or gate/up weights mixing {'/'.join(sorted(mixed))} run part by part")
        elif other - set(UNQUANTIZED_TYPES):
            quantization = "int8"
        if quantization and other:
            reasons.append(f"its {'/'.join(sorted(other))} weights are requantized to int8 per channel")
    kv_cache_dtype = config.kv_cache_dtype
    if quantization and on_cpu and auto:
        dtype = torch.float32  # the fused decoder stack and the quantized kernels take fp32 activations
        if kv_cache_dtype == "auto" and config.quantization is None:
            kv_cache_dtype = default_kv_cache_dtype(cpu.flags)
            reasons.append("bf16 KV cache: half the bytes of fp32, read in place by AVX512-BF16"
                           if kv_cache_dtype == "bfloat16" else
                           "fp16 KV cache: half the bytes of fp32; without AVX512-BF16 both convert to fp32 at the "
                           "same speed, and fp16 keeps 3 more bits")
    else:
        dtype = parse_dtype(config.dtype)
        if auto:
            reasons.append("bf16: the CPU has native bf16" if dtype == torch.bfloat16 and on_cpu
                           else f"{_name(dtype)} by default on {config.device}")
    if not quantization:
        return ExecutionPlan(dtype, None, group_size, None, 0, reasons, kv_cache_dtype)
    dense = torch.bfloat16 if (dtype == torch.bfloat16 or (auto and cpu.native_bf16)) else torch.float32
    if not on_cpu:
        return ExecutionPlan(dtype, quantization, group_size, dense, 0, reasons, kv_cache_dtype, fallback=fallback,
                             native_types=native)
    if quantization in ("int4", "int8") and _amx():
        reasons.append("products of many rows over the int4 / int8 / Q8_0 blocks run on AMX tiles (the AVX-512 VNNI "
                       "kernels' results, bit for bit)")
    copy = True
    if path is not None:
        need, limit = dense_weight_bytes(path, dense), int(machine_memory() * DENSE_COPY_MEMORY_FRACTION)
        copy = need <= limit
        if not copy:
            reasons.append(f"big steps dequantize the weights per call: a dense copy would take {need / 2**30:.1f} "
                           f"GiB, more than 1/{round(1 / DENSE_COPY_MEMORY_FRACTION)} of the memory")
    if config.kernel_max_rows is not None or not measure:
        rows = KERNEL_MAX_ROWS if config.kernel_max_rows is None else config.kernel_max_rows
        reasons.append(f"kernel_max_rows {rows} as configured")
        return ExecutionPlan(dtype, quantization, group_size, dense, rows, reasons, kv_cache_dtype, fallback=fallback,
                             dense_copy=copy, native_types=native)
    from pagedlm.model.probe import HEAD_SHAPE, measure_kernel_max_rows

    rows, why = measure_kernel_max_rows(quantization, group_size, dense, copy=copy)
    head = "bf16" if quantization == "bf16" else "int8"
    head_rows, head_why = measure_kernel_max_rows(head, 32, dense, HEAD_SHAPE, copy=copy)
    reasons += [why, f"{head} LM head: {head_why}"]
    return ExecutionPlan(dtype, quantization, group_size, dense, rows, reasons, kv_cache_dtype, head_rows, fallback,
                         copy, native)
