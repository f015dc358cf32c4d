"""The decoder stack in one compiled call for steps with few new tokens (csrc/llama_decode.cpp): LLaMA-style layers
(QK-norms, sliding windows, q/k/v biases and clamping, experts) and Gemma 3's.

A single-stream decode step runs about 40 small torch ops per layer; with quantized weights their dispatch costs as
much as the matmuls. This path hands the residual stream, the layers' weights and the batch layout to one C++
function instead, where it gives the torch path's results (CPU, fp32 activations, an fp32, bf16, fp16 or int8 KV
cache, the compiled attention backend, at most `max_tokens` new tokens: the quantized layers' `kernel_max_rows`) and
is skipped otherwise. A model describes its layers to it as a `FusedStack` (`CausalLM.fused_stack`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedlm import cbuild
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import KERNEL_MAX_ROWS
from pagedlm.kvcache.format import KV_BF16, KV_F16, KV_F32, KV_INT8, kv_kind
from pagedlm.model.layers import Linear
from pagedlm.model.quant import (
    GGUF_KINDS,
    Bf16Linear,
    ConcatLinear,
    GGUFLinear,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    WithBias,
)
from pagedlm.model.step_rows import path_rows

SOURCE = Path(__file__).parent / "csrc" / "llama_decode.cpp"
(LIN_F32T, LIN_INT8, LIN_INT4, LIN_INT8_PACKED, LIN_INT4_X16, LIN_INT8_X16, LIN_BF16_X16, LIN_INT4_X16_K,
 LIN_GGUF_X16, LIN_CONCAT) = range(10)
INT4_KINDS = {"rows": LIN_INT4, "x16": LIN_INT4_X16, "x16_k": LIN_INT4_X16_K}  # by Int4Linear.layout
FUSED_KV_KINDS = (KV_F32, KV_BF16, KV_F16, KV_INT8)  # the caches the stack writes (not fp8)
# Steps with more tokens over fp32 weights run layer by layer: torch's sgemm beats the stack's simple fp32 product
# there (Gemma 3 prefill 445 against 290 tok/s at 1,024 tokens).
F32_MAX_TOKENS = 64


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("K", ctypes.c_int), ("N", ctypes.c_int), ("G", ctypes.c_int),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("mins", ctypes.c_void_p),
                ("planes", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("attn_out_norm", ctypes.c_void_p),
                ("mlp_out_norm", ctypes.c_void_p), ("window", ctypes.c_int), ("rope", ctypes.c_int),
                ("group", ctypes.c_int), ("qkv_bias", ctypes.c_void_p), ("qk_norm_whole", ctypes.c_int),
                ("clip_qkv", ctypes.c_float), ("router", ctypes.c_void_p),
                ("num_experts", ctypes.c_int), ("top_k", ctypes.c_int), ("norm_topk", ctypes.c_int),
                ("exp_gate_up", ctypes.c_void_p), ("exp_down", ctypes.c_void_p), ("expert_counts", ctypes.c_void_p),
                ("shared_gate_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p), ("shared_gate", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int), ("hidden", ctypes.c_int), ("H", ctypes.c_int), ("KVH", ctypes.c_int),
                ("D", ctypes.c_int), ("inter", ctypes.c_int), ("BS", ctypes.c_int), ("num_blocks", ctypes.c_int),
                ("kv_kind", ctypes.c_int), ("eps", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)),
                ("final_norm", ctypes.c_void_p), ("act", ctypes.c_int), ("scale", ctypes.c_float)]


class _Group(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
                ("query_start_loc", ctypes.c_void_p), ("max_blocks", ctypes.c_int)]


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}  # csrc's Activation
MAX_ROPES = 2


@dataclass
class FusedExperts:
    """A mixture-of-experts MLP as the stack runs it (model/moe.py's routing): router [experts, hidden] fp32
    logits, softmax, the top_k (renormalized if norm_topk), each expert a LlamaMLP whose gate_up / down the kernel
    reads; counts (int64 [experts]) gains the tokens routed to each. `shared` (a LlamaMLP, Qwen2-MoE) runs for every
    token, times sigmoid(shared_gate [1, hidden] . x)."""

    router: torch.Tensor
    top_k: int
    norm_topk: bool
    experts: list[nn.Module]
    counts: torch.Tensor
    shared: nn.Module | None = None
    shared_gate: torch.Tensor | None = None


@dataclass
class FusedLayer:
    """One decoder layer as the stack runs it: x += attn_out_norm(attn(input_norm(x))), then
    x += mlp_out_norm(down(act(gate) * up)(post_norm(x))); norms are fp32 weight vectors multiplied as they are
    (Gemma's 1 + w already added), None where the layer has none."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    q_norm: torch.Tensor | None = None  # per head, before RoPE (qk_norm_whole: over the whole projection)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int | None = None
    rope: int = 0  # which of the step's rotary tables
    qkv_bias: torch.Tensor | None = None  # fp32, added to the q/k/v projection's output (the projection has none)
    moe: FusedExperts | None = None  # the MLP is a mixture of experts (gate_up and down: None)
    qk_norm_whole: bool = False  # q_norm / k_norm over the whole q / k projection (OLMoE)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] after the norms (OLMoE)


@dataclass
class FusedStack:
    layers: list[FusedLayer]
    final_norm: torch.Tensor
    activation: str  # a key of ACTIVATIONS
    scale: float  # attention's softmax scale


def _configure(lib: ctypes.CDLL) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.pagedlm_llama_decode.argtypes = [ctypes.POINTER(_Model), p, i, p, p, ctypes.POINTER(_Group), i, i, p, i]
    lib.pagedlm_llama_decode.restype = i
    lib.pagedlm_moe_experts.argtypes = [ctypes.POINTER(_Linear), ctypes.POINTER(_Linear), p, i, p, p, i, i]
    lib.pagedlm_moe_experts.restype = i


KERNEL = cbuild.KernelLibrary(SOURCE, "Fused decode kernel", "decoding layer by layer in torch", _configure,
                              disable=("PAGEDLM_DISABLE_FUSED_DECODE",))


def load_decode_kernel() -> ctypes.CDLL | None:
    return KERNEL.load()


def split_bias(linear: nn.Module) -> tuple[nn.Module, torch.Tensor | None]:
    """(the layer whose product the kernel reads, the bias it adds itself): a quantized layer's bias comes apart
    from it (`WithBias`); a `Linear` keeps its own, which `_describe(..., bias_apart=True)` then leaves out."""
    if isinstance(linear, WithBias):
        return linear.linear, linear.bias
    return linear, getattr(linear, "bias", None)


def _describe(linear: nn.Module, bias_apart: bool = False) -> _Linear | None:
    """The kernel's view of a linear layer, or None for a layout it does not read (a `Linear` with a bias: unless
    the stack adds that bias itself, `bias_apart`)."""
    if isinstance(linear, Linear):
        w = linear.weight
        if not linear.transposed or w.dtype != torch.float32 or (linear.bias is not None and not bias_apart):
            return None
        return _Linear(LIN_F32T, linear.in_features, linear.out_features, 0, w.data_ptr(), None, None)
    if isinstance(linear, Int8Linear):
        kind = LIN_INT8_X16 if linear.x16 else LIN_INT8_PACKED if linear.packed else LIN_INT8
        return _Linear(kind, linear.in_features, linear.out_features, 0, linear.qweight.data_ptr(),
                       linear.scale.data_ptr(), None)
    if isinstance(linear, Bf16Linear):
        return _Linear(LIN_BF16_X16, linear.in_features, linear.out_features, 0, linear.qweight.data_ptr(), None,
                       None) if linear.x16 else None
    if isinstance(linear, ConcatLinear):
        parts = [_describe(p) for p in linear.parts]
        if any(p is None or p.kind == LIN_CONCAT for p in parts):
            return None
        array = (_Linear * len(parts))(*parts)
        lin = _Linear(LIN_CONCAT, linear.in_features, linear.out_features, len(parts), ctypes.addressof(array), None,
                      None, None)
        lin.parts = array  # kept alive with the description (LlamaDecodeKernel holds it)
        return lin
    if isinstance(linear, GGUFLinear):
        codes, planes, scale, aux = linear._pointers()
        return _Linear(LIN_GGUF_X16, linear.in_features, linear.out_features, GGUF_KINDS[linear.kind], codes, scale,
                       aux, planes)
    if isinstance(linear, Int4Linear):
        mins = linear.mins.data_ptr() if linear.mins.numel() else None  # Q4_0's x16 layout: none
        return _Linear(INT4_KINDS[linear.layout], linear.in_features, linear.out_features, linear.group_size,
                       linear.qweight.data_ptr(), linear.scale.data_ptr(), mins)
    return None


def _describe_mlps(mlps: list[nn.Module]) -> tuple[list[_Linear | None], list[_Linear | None]]:
    """The kernel's view of each gated MLP's (a LlamaMLP's) gate_up and down products (None: one it does not read)."""
    return [_describe(m.gate_up_proj) for m in mlps], [_describe(m.down_proj) for m in mlps]


def _describe_experts(moe: FusedExperts, hidden: int) -> tuple[ctypes.Array, ctypes.Array] | None:
    """Arrays of every expert's gate_up and down products, as the kernel reads them, or None."""
    gate_up, down = _describe_mlps(moe.experts)
    r, c, g = moe.router, moe.counts, moe.shared_gate
    shared = None if moe.shared is None else tuple(lins[0] for lins in _describe_mlps([moe.shared]))
    if (any(lin is None for lin in (*gate_up, *down, *(shared or ()))) or r.dtype != torch.float32
            or not r.is_contiguous() or r.shape != (len(moe.experts), hidden) or c.dtype != torch.int64
            or c.shape != (len(moe.experts),) or not 0 < moe.top_k <= len(moe.experts)
            or (shared is not None and (g is None or g.dtype != torch.float32 or not g.is_contiguous()
                                        or g.numel() != hidden))):
        return None
    arrays = (_Linear * len(gate_up))(*gate_up), (_Linear * len(down))(*down)
    arrays[0].described, arrays[1].described = gate_up, down  # a LIN_CONCAT's parts live with its description
    arrays[0].shared = shared  # kept alive with them too
    return arrays


def _batch_layout_ok(meta: AttentionMetadata, num_tokens: int) -> bool:
    """The batch tensors have the layout the kernel reads (their contents it checks itself)."""
    tables, slots, seq_lens, qsl = meta.block_tables, meta.slot_mapping, meta.seq_lens, meta.query_start_loc
    return (tables.dtype == seq_lens.dtype == qsl.dtype == torch.int32 and slots.dtype == torch.int64
            and all(t.is_contiguous() for t in (tables, slots, seq_lens, qsl))
            and slots.numel() == num_tokens and tables.shape[0] == seq_lens.numel() == qsl.numel() - 1)


class LlamaDecodeKernel:
    """Binds a loaded (and possibly quantized) model's `FusedStack` and its KV caches to the compiled stack.

    Holds raw pointers to the model's weights: build it after the weights reached their final layout and
    rebuild it if they move. `run` returns False, having changed nothing, when it cannot take the batch."""

    def __init__(self, lib: ctypes.CDLL, model: nn.Module, stack: FusedStack,
                 weights: list[tuple[_Linear, ...]]) -> None:
        cfg = model.cfg
        self.lib, self.model, self.cfg, self.stack = lib, model, cfg, stack
        self.max_tokens = min((m.kernel_max_rows for m in model.layers.modules() if isinstance(m, QuantLinear)),
                              default=KERNEL_MAX_ROWS)
        described = [lin for lins in weights for item in lins
                     for lin in (item if isinstance(item, ctypes.Array) else [item]) if lin.K]  # not the MoE layers'
        if any(lin.kind == LIN_F32T for lin in described):  # empty gate_up / down
            self.max_tokens = min(self.max_tokens, F32_MAX_TOKENS)
        self._weights = weights
        self._layers = (_Layer * cfg.num_layers)()
        for i, (layer, (qkv, o, gate_up, down, *experts)) in enumerate(zip(stack.layers, weights)):
            self._layers[i] = _Layer(_ptr(layer.input_norm), _ptr(layer.post_norm), qkv, o, gate_up, down, None, None,
                                     _ptr(layer.q_norm), _ptr(layer.k_norm), _ptr(layer.attn_out_norm),
                                     _ptr(layer.mlp_out_norm), layer.window or 0, layer.rope, 0,
                                     _ptr(layer.qkv_bias), int(layer.qk_norm_whole), layer.clip_qkv or 0.0)
            if layer.moe is not None:
                moe, (exp_gate_up, exp_down) = layer.moe, experts
                row = self._layers[i]
                row.router, row.num_experts, row.top_k = moe.router.data_ptr(), len(moe.experts), moe.top_k
                row.norm_topk, row.expert_counts = int(moe.norm_topk), moe.counts.data_ptr()
                row.exp_gate_up, row.exp_down = ctypes.addressof(exp_gate_up), ctypes.addressof(exp_down)
                if exp_gate_up.shared is not None:
                    shared_gate_up, shared_down = exp_gate_up.shared
                    row.shared_gate_up, row.shared_down = map(ctypes.addressof, (shared_gate_up, shared_down))
                    row.shared_gate = moe.shared_gate.data_ptr()
        self._model = _Model(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size, 0, 0, KV_F32, cfg.rms_norm_eps, self._layers,
                             _ptr(stack.final_norm), ACTIVATIONS[stack.activation], stack.scale)
        self._groups = (_Group * cfg.num_layers)()  # at most one KV cache group per layer
        self._num_ropes = 1 + max(layer.rope for layer in stack.layers)  # rotary tables a step must bring
        self._bound_caches: tuple[int, ...] = ()
        self._bound_list: list | None = None

    @classmethod
    def create(cls, model: nn.Module) -> LlamaDecodeKernel | None:
        """None where the kernel is unavailable or the model has a layer it does not read."""
        from pagedlm.attention.cpu_kernel import HEAD_DIMS

        cfg = model.cfg
        stack = model.fused_stack()
        if stack is None or stack.activation not in ACTIVATIONS:
            return None
        lib = load_decode_kernel()
        if lib is None or cfg.head_dim not in HEAD_DIMS or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads > 64:
            return None
        weights = []
        for layer in stack.layers:
            norms = (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.attn_out_norm,
                     layer.mlp_out_norm, layer.qkv_bias)
            if any(w is not None and (w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous())
                   for w in (*norms, stack.final_norm)) or (layer.q_norm is None) != (layer.k_norm is None):
                return None
            if not 0 <= layer.rope < MAX_ROPES or (layer.qkv_bias is not None and layer.qkv_bias.numel() != (
                    cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim):
                return None
            lins = [_describe(layer.qkv, bias_apart=layer.qkv_bias is not None), _describe(layer.o)]
            if layer.moe is None:
                lins += [_describe(layer.gate_up), _describe(layer.down)]
            elif (experts := _describe_experts(layer.moe, cfg.hidden_size)) is None:
                return None
            else:
                lins += [_Linear(), _Linear(), *experts]
            if any(lin is None for lin in lins):
                return None
            weights.append(tuple(lins))
        return cls(lib, model, stack, weights)

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        if kv_caches is self._bound_list:  # the runner passes the same list every step
            return True
        key = tuple(t.data_ptr() for kv in kv_caches for t in kv)
        if key == self._bound_caches:
            self._bound_list = kv_caches
            return True
        kinds = {kv_kind(k, self.cfg.head_dim) for k, _ in kv_caches}
        shape = kv_caches[0][0].shape
        if len(kinds) != 1 or not kinds <= set(FUSED_KV_KINDS) or len(kv_caches) != self.cfg.num_layers or not all(
                k.shape == v.shape == shape and k.dtype == v.dtype and k.is_contiguous() and v.is_contiguous()
                and k.device.type == "cpu" for k, v in kv_caches) or shape[2] != self.cfg.num_kv_heads:
            return False
        self._model.kv_kind = kinds.pop()
        for i, (k, v) in enumerate(kv_caches):
            self._layers[i].k_cache, self._layers[i].v_cache = k.data_ptr(), v.data_ptr()
        self._model.BS, self._model.num_blocks = shape[1], shape[0]
        self._bound_caches, self._bound_list = key, kv_caches
        return True

    def _bind_groups(self, metas: list[AttentionMetadata], cos: list[torch.Tensor], sin: list[torch.Tensor],
                     n: int) -> int:
        """Each layer's KV cache group (its metadata object), set in the layer table; the number of groups, 0 where
        the batch tensors do not have the layout the kernel reads."""
        groups: dict[int, int] = {}
        for i, meta in enumerate(metas):
            g = groups.get(id(meta))
            if g is None:
                g = groups[id(meta)] = len(groups)
                if (g == len(self._groups) or not _batch_layout_ok(meta, n)
                        or meta.block_tables.shape[0] != metas[0].block_tables.shape[0]):
                    return 0
                self._groups[g] = _Group(meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
                                         meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(),
                                         meta.block_tables.shape[1])
            if self._layers[i].group != g:
                self._layers[i].group = g
        if not all(c.dtype == s.dtype == torch.float32 and c.is_contiguous() and s.is_contiguous()
                   and c.shape[0] == s.shape[0] == n for c, s in zip(cos, sin)):
            return 0
        return len(groups)

    def run(self, x: torch.Tensor, cos: torch.Tensor | list[torch.Tensor], sin: torch.Tensor | list[torch.Tensor],
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata],
            out_qsl: torch.Tensor | None = None) -> bool:
        """Run the hidden states `x` [tokens, hidden] (fp32, contiguous) through every layer and the final norm,
        in place. `cos`, `sin`: the step's rotary tables [tokens, head_dim / 2] (a list where layers use
        several); `metas`: each layer's batch layout (layers of one KV cache group share one object). `out_qsl`
        (int32 [num_seqs + 1], AttentionMetadata.suffix_query_start_loc's): past the last layer's K/V write only
        each sequence's last out_qsl[i + 1] - out_qsl[i] tokens go on, into x's first out_qsl[-1] rows."""
        n = x.shape[0]
        cos, sin = ([cos], [sin]) if isinstance(cos, torch.Tensor) else (cos, sin)
        if (path_rows(n) > self.max_tokens or x.dtype != torch.float32 or not x.is_contiguous()
                or len(metas) != len(self._layers)
                or len(cos) != len(sin) or not self._num_ropes <= len(cos) <= MAX_ROPES
                or not self._bind_caches(kv_caches) or not (num_groups := self._bind_groups(metas, cos, sin, n))):
            return False
        num_seqs = metas[0].block_tables.shape[0]
        if out_qsl is not None and (out_qsl.dtype != torch.int32 or not out_qsl.is_contiguous()
                                    or out_qsl.shape != (num_seqs + 1,)):
            raise ValueError(f"out_qsl: int32 [{num_seqs + 1}] offsets expected, got {out_qsl.dtype} "
                             f"{tuple(out_qsl.shape)}")
        cos_p = (ctypes.c_void_p * MAX_ROPES)(*(c.data_ptr() for c in cos))
        sin_p = (ctypes.c_void_p * MAX_ROPES)(*(s.data_ptr() for s in sin))
        rc = self.lib.pagedlm_llama_decode(ctypes.byref(self._model), x.data_ptr(), n, cos_p, sin_p, self._groups,
                                           num_groups, num_seqs, _ptr(out_qsl), torch.get_num_threads())
        if rc:
            raise cbuild.kernel_error(rc, f"fused decode kernel ({self._model.num_blocks} KV blocks)")
        return True


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class ExpertsKernel:
    """A mixture-of-experts MLP's experts bound to the compiled `pagedlm_moe_experts`: one token through its k
    chosen experts in one call (layer by layer, each expert is two kernel calls and a few torch ops). Holds raw
    pointers to the experts' weights, as `LlamaDecodeKernel` does: build it once they are in their final layout."""

    def __init__(self, lib: ctypes.CDLL, gate_up: list[_Linear], down: list[_Linear], act: int) -> None:
        self.lib, self.gate_up, self.down, self.act = lib, gate_up, down, act

    @classmethod
    def create(cls, experts: list[nn.Module], activation: str) -> ExpertsKernel | None:
        """None where the kernel is unavailable or an expert (a LlamaMLP) has a layer it does not read."""
        lib = load_decode_kernel()
        if lib is None or activation not in ACTIVATIONS:
            return None
        gate_up, down = _describe_mlps(experts)
        if any(lin is None or lin.kind == LIN_F32T for lin in (*gate_up, *down)):
            return None  # fp32 weights: torch's products are as fast, and the stack's would round differently
        return cls(lib, gate_up, down, ACTIVATIONS[activation])

    def run(self, x: torch.Tensor, experts: list[tuple[int, float]]) -> torch.Tensor | None:
        """sum of weight x expert(x) over `experts` ((expert, weight) pairs, added in that order) for the one
        token `x` [1, hidden]; None (nothing done) where x is not a contiguous fp32 CPU row."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.shape[0] != 1:
            return None
        k = len(experts)
        gate_up = (_Linear * k)(*(self.gate_up[e] for e, _ in experts))
        down = (_Linear * k)(*(self.down[e] for e, _ in experts))
        weights = (ctypes.c_float * k)(*(w for _, w in experts))
        out = torch.empty_like(x)
        rc = self.lib.pagedlm_moe_experts(gate_up, down, weights, k, x.data_ptr(), out.data_ptr(), self.act,
                                          torch.get_num_threads())
        if rc:
            raise cbuild.kernel_error(rc, "fused experts kernel")
        return out
