"""Model surgery: every layers.Linear of a model replaced by its quantized twin (model/quant/), one by one as the
checkpoint streams in (`LinearQuantizer`, a `CausalLM.load_weights` finalize) or over a loaded model
(`quantize_model`)."""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.config import KERNEL_MAX_ROWS
from pagedlm.hub.blocks import Int4Blocks, LazyRows, RawBlocks
from pagedlm.model.quant import (
    METHODS,
    Bf16Linear,
    GGUFLinear,
    Int8Linear,
    QuantLinear,
    TableEmbedding,
    WithBias,
    make_quant_linear,
)
from pagedlm.model.quant.concat import ConcatLinear, native_layer, one_int4_layout, runs_natively


class LinearQuantizer:
    """Quantizes a model's layers one by one: called as `load_weights`'s `finalize`, it turns each layers.Linear
    into its quantized twin as soon as that Linear is loaded (int4 blocks the checkpoint stores, from
    `model.native_weights`, as they are; other weights with `fallback`, None: `method`), so that the model never
    exists in full precision; `finish` then does the embedding table and the dense copies."""

    def __init__(self, model: nn.Module, method: str, group_size: int = 32, fallback: str | None = None,
                 native: tuple[str, ...] = ()) -> None:
        if method not in METHODS or fallback not in (None, *METHODS):
            raise ValueError(f"quantization must be one of {METHODS} or None, got {method!r} / {fallback!r}")
        self.model, self.method, self.group_size, self.fallback = model, method, group_size, fallback
        self.native = native  # GGUF kinds kept as stored: the vocabulary tables' too (lazy rows until then)

    def __call__(self, name: str, child: nn.Module) -> nn.Module:
        """The quantized replacement of the loaded Linear `child` (module name `name`), or of the embedding table:
        an int8 (bf16 for "bf16") table, which a tied LM head then shares (`finish`), or its GGUF blocks as stored
        where a kernel runs them (`embed` looks their rows up). GGUF blocks come as stored:
        int4 kinds to Int4Linear, Q5 / Q6_K / Q8_0 to GGUFLinear, a fused weight whose parts mix kinds to a
        ConcatLinear of those, where the kernels run them; anything else to `fallback`."""
        w = getattr(self.model, "native_weights", {}).pop(f"{name}.weight", None)
        if isinstance(w, LazyRows) and w.tensor.tensor_type.name in self.native:
            raw = w.blocks()  # a vocabulary table (or untied LM head) of a kind a kernel runs: as stored
            w = raw if runs_natively(raw) else w
        if isinstance(child, nn.Embedding):
            w = child.weight.data if w is None else w
            table = (Bf16Linear(_dense(w)) if self.method == "bf16" else native_layer(w) if isinstance(w, RawBlocks)
                     else Int8Linear(w))
            return TableEmbedding(table, child.weight.dtype)
        method = self.method
        if isinstance(w, RawBlocks) and not one_int4_layout(w):  # a 5- to 8-bit kind, or parts of several
            quantized = GGUFLinear(w) if GGUFLinear.supports(w) else ConcatLinear.from_blocks(w)
            if quantized is not None:
                return quantized if child.bias is None else WithBias(quantized, child.bias)
            w = w.dequantize()
        if not isinstance(w, (Int4Blocks, RawBlocks)):
            w = w if w is not None else child.weight.data.t() if child.transposed else child.weight.data
            method = self.fallback or self.method
            w = w if method == "int8" else _dense(w)  # int8 quantizes lazy rows by rows
        quantized = make_quant_linear(w, method, self.group_size)
        return quantized if child.bias is None else WithBias(quantized, child.bias)

    def finish(self, dense_dtype: torch.dtype | None = None, kernel_max_rows: int = KERNEL_MAX_ROWS,
               head_kernel_max_rows: int | None = None, dense_copy: bool = True) -> int:
        """Once every layer is quantized: a tied LM head shares the embedding table; products with more than
        `kernel_max_rows` rows (`head_kernel_max_rows` for the table, None: the same) use a dense copy in
        `dense_dtype`, or without `dense_copy` the weight dequantized to it per call (None: dequantize per call in
        fp32). Returns the bytes of the dense copies."""
        model = self.model
        if native := getattr(model, "native_weights", {}):
            raise ValueError(f"int4 blocks for weights that are not linear layers: {sorted(native)[:4]}")
        if not isinstance(model.embed_tokens, TableEmbedding):
            model.embed_tokens = self("embed_tokens", model.embed_tokens)
        table = model.embed_tokens.table
        if model.cfg.tie_word_embeddings:
            model.lm_head = table
        dense_bytes = 0
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.kernel_max_rows = kernel_max_rows
                if m is table and head_kernel_max_rows is not None:
                    m.kernel_max_rows = head_kernel_max_rows
                m.set_dense(dense_dtype if m.kernel_max_rows < KERNEL_MAX_ROWS else None, dense_copy)
                dense_bytes += 0 if m.dense is None else m.dense.numel() * m.dense.element_size()
        return dense_bytes


def _dense(w: torch.Tensor | LazyRows) -> torch.Tensor:
    return w.materialize() if isinstance(w, LazyRows) else w


def quantize_model(model: nn.Module, method: str, group_size: int = 32, dense_dtype: torch.dtype | None = None,
                   kernel_max_rows: int = KERNEL_MAX_ROWS, head_kernel_max_rows: int | None = None,
                   fallback: str | None = None) -> int:
    """Replace, in place, every layers.Linear of a loaded `model` ([out, in] or transposed) by its quantized twin
    and the embedding table by an int8 one (see LinearQuantizer). Returns the bytes of the dense copies."""
    from pagedlm.model.layers import Linear

    quantizer = LinearQuantizer(model, method, group_size, fallback)
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, quantizer(f"{prefix}.{name}".lstrip("."), child))
    return quantizer.finish(dense_dtype, kernel_max_rows, head_kernel_max_rows)
