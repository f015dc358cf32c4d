"""A fused weight (q/k/v, gate/up) whose parts the file stores in different block kinds, as Q4_K_M files do (a Q6_K v
beside Q4_K q and k in a third of the layers; Gemma 3's Q8_0 v beside Q5_0 q and k): each run of parts of one kind
keeps its own layer and kernel, and their outputs sit side by side, instead of the whole weight being requantized."""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.hub.blocks import RawBlocks
from pagedlm.model.quant.formats import X16
from pagedlm.model.quant.gguf import GGUFLinear
from pagedlm.model.quant.int4 import Int4Linear
from pagedlm.model.quant.kernel import x16_native
from pagedlm.model.quant.linear import QuantLinear

_ONE_LAYOUT = {"Q4_0", "Q4_1"}  # kinds one int4 layout holds together (fp16 scales and minimums)


def runs(weight: RawBlocks) -> list[RawBlocks]:
    """`weight`'s parts grouped into consecutive runs that one layer holds."""
    out: list[RawBlocks] = []
    names = weight.names if len(weight.names) == len(weight.parts) else [None] * len(weight.parts)
    for part, name in zip(weight.parts, names):
        kind, named = part[1], [name] if name else []
        if out and (out[-1].kinds == {kind} or out[-1].kinds | {kind} <= _ONE_LAYOUT):
            out[-1] = RawBlocks(out[-1].parts + [part], weight.cols, [], out[-1].names + named)
        else:
            out.append(RawBlocks([part], weight.cols, [], named))
    return out


def one_int4_layout(weight: RawBlocks) -> bool:
    """Whether one Int4Linear holds `weight` as stored (Q4_0 / Q4_1 together, or Q4_K alone)."""
    return weight.kinds <= _ONE_LAYOUT or weight.kinds == {"Q4_K"}


def runs_natively(weight: RawBlocks) -> bool:
    """Whether a layer runs `weight` (one kind, or Q4_0 / Q4_1) in an x16 layout of its own here."""
    if one_int4_layout(weight):
        return weight.shape[0] % X16 == 0 and x16_native(4)
    return GGUFLinear.supports(weight)


def native_layer(weight: RawBlocks) -> QuantLinear:
    """The layer that runs `weight` as stored (int4 kinds: Int4Linear; Q5 / Q6_K / Q8_0: GGUFLinear)."""
    return Int4Linear(weight, 32, x16=True) if one_int4_layout(weight) else GGUFLinear(weight)


class ConcatLinear(QuantLinear):
    """Parts [out_i, in] side by side: y = [part_0(x), part_1(x), ...]. Each part is a QuantLinear of its own (its
    kernel, its dense copy for big steps); the fused decoder stack runs them one after the other."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts))
        self.parts = nn.ModuleList(parts)

    @classmethod
    def from_blocks(cls, weight: RawBlocks) -> "ConcatLinear | None":
        """One layer per run of `weight`'s parts, or None where some run has no native layer here."""
        parts = runs(weight)
        if not all(runs_natively(run) for run in parts):
            return None
        layers = [native_layer(run) for run in parts]
        weight.converted()
        return cls(layers)

    def set_dense(self, dtype: torch.dtype | None, copy: bool = True) -> None:
        for p in self.parts:
            p.set_dense(dtype, copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def dense_input(self, x: torch.Tensor) -> torch.Tensor:
        inputs = [p.dense_input(x) for p in self.parts]
        if any(not torch.equal(i, inputs[0]) for i in inputs[1:]):  # e.g. Q4_K (per 256 values) beside Q6_K
            raise ValueError("the parts quantize their activations differently: take each part's")
        return inputs[0]
