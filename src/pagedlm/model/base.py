"""What every model family shares: the serving forward contract, HF checkpoint loading (q/k/v and gate/up fused on
the way in, int4 blocks set aside for quantization), weight repacking after loading, and the defaults for the
fused decode path and the MoE layers."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.attention import AttentionBackend, AttentionMetadata
from pagedlm.config import ModelConfig
from pagedlm.hub.blocks import Int4Blocks, LazyRows, RawBlocks
from pagedlm.model.layers import Linear

if TYPE_CHECKING:
    from pagedlm.model.llama_decode import FusedStack, LlamaDecodeKernel
    from pagedlm.model.weight_cache import WeightCacheStats


class CausalLM(nn.Module):
    """A decoder over a flat token batch with K/V in the paged cache.

    A family builds `embed_tokens`, `layers` (each with an `mlp`), `norm` and `lm_head` (None: tied to the
    embedding) and implements `run_layers`; it may override `embed` and `compute_logits`. `sliding_window` and
    `layer_sliding_windows[i]` (None: a full-attention layer) tell the engine which layers only ever read the last
    `sliding_window` positions.
    """

    # HF checkpoint names of the projections stored fused: part name -> (fused name, index).
    FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.sliding_window = cfg.sliding_window
        self.layer_sliding_windows = cfg.layer_sliding_windows
        # checkpoint tensors kept in their own format for `finalize`, by parameter name (_copy)
        self.native_weights: dict[str, Int4Blocks | RawBlocks | LazyRows] = {}
        self._decode_kernel: LlamaDecodeKernel | None | bool = False  # False: not built yet
        self.weight_cache: WeightCacheStats | None = None  # what the load mapped and converted (load_model)

    # ---- forward -------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata],
                backend: AttentionBackend, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_caches[i], metas[i]: layer i's paged K/V and the batch layout of
        its KV cache group; `backend` writes and reads them. Returns logits [len(logits_indices), vocab] (all
        tokens if None)."""
        return self.logits_and_hidden(input_ids, positions, kv_caches, metas, backend, logits_indices)[0]

    def logits_and_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata],
                          backend: AttentionBackend, logits_indices: torch.Tensor | None = None,
                          hidden_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`'s logits, and the final hidden states (after the final norm: what the LM head reads) of the
        rows `hidden_indices` [len(hidden_indices), hidden] (None without them)."""
        x = self.embed(input_ids)
        out_qsl = None
        if (hidden_indices is None and logits_indices is not None and metas and x.device.type == "cpu"
                and logits_indices.numel() < x.shape[0]):
            rows = metas[0].suffix_query_start_loc(logits_indices.tolist())
            out_qsl = None if rows is None else torch.tensor(rows, dtype=torch.int32)
        x, normed, only_out = self.run_layers(x, positions, kv_caches, metas, backend, out_qsl)
        hidden = None
        if hidden_indices is not None:
            hidden = x[hidden_indices] if normed else self.norm(x[hidden_indices])
        if only_out:
            x = x[:logits_indices.numel()]
        elif logits_indices is not None:
            x = x[logits_indices]
        if not normed:
            x = self.norm(x)
        return self.compute_logits(x), hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   metas: list[AttentionMetadata], backend: AttentionBackend,
                   out_qsl: torch.Tensor | None = None) -> tuple[torch.Tensor, bool, bool]:
        """The hidden states after every layer, whether the final norm was applied to them too (a fused stack may
        do that), and whether they are only the rows `out_qsl` names (each sequence's last out_qsl[i + 1] -
        out_qsl[i] query tokens, in x's first rows: a fused stack may finish only those; every row's K/V is
        written either way)."""
        raise NotImplementedError

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied and not given a head of its own
            return F.linear(x, self.embed_tokens.weight)
        return self.lm_head(x)

    # ---- capabilities --------------------------------------------------------------------------------------

    def fused_stack(self) -> FusedStack | None:
        """This model's layers as the fused decoder stack (llama_decode.py) runs them, or None where it cannot."""
        return None

    def decode_kernel(self) -> LlamaDecodeKernel | None:
        """The fused decoder stack for small steps, bound on first use (by then the weights are in their final
        layout: repacked, quantized), or None (layer by layer)."""
        if self._decode_kernel is False:
            from pagedlm.model.llama_decode import LlamaDecodeKernel

            self._decode_kernel = LlamaDecodeKernel.create(self)
        return self._decode_kernel

    def moe_blocks(self) -> list[tuple[int, nn.Module]]:
        """(layer index, SparseMoE) of every layer with experts."""
        from pagedlm.model.moe import SparseMoE

        return [(i, layer.mlp) for i, layer in enumerate(self.layers) if isinstance(layer.mlp, SparseMoE)]

    # ---- weights -------------------------------------------------------------------------------------------

    def process_weights_after_loading(self) -> None:
        """Once every weight is in its final format: let each remaining Linear repack its weight for speed (see
        `Linear.process_weights_after_loading`; idempotent)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.process_weights_after_loading()

    def param_name(self, name: str) -> str:
        """The parameter a checkpoint tensor `name` goes to (before q/k/v and gate/up fusing)."""
        return name.removeprefix("model.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | Int4Blocks]],
                     finalize: Finalize | None = None, device: torch.device | str = "cpu") -> None:
        """Take HF-named tensors in checkpoint order, fusing q/k/v and gate/up. A parameter still on the meta device
        (built under `layers.deferred_weights`) becomes the tensor itself (on `device`), any other one is copied
        into. As soon as a Linear or the embedding table has all its parameters it is handed to
        `finalize(name, module)`, whose result takes its place: a quantizer turns each weight into its final format
        while the rest still loads, so at most one full-precision weight exists at a time (default: a Linear's
        `process_weights_after_loading`).
        Raises on missing or unexpected tensors; int4 blocks and lazy rows are set aside in `native_weights` for
        `finalize`."""
        params = dict(self.named_parameters())
        waiting = {name: {p for p, _ in m.named_parameters()} for name, m in self.named_modules()
                   if isinstance(m, (Linear, nn.Embedding))}
        finalize = finalize or _process
        pending: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor | Int4Blocks) -> None:
            self._copy(params, name, tensor, device)
            loaded.add(name)
            owner, _, attr = name.rpartition(".")
            if owner in waiting:
                waiting[owner].discard(attr)
                if not waiting[owner]:
                    del waiting[owner]
                    parent, _, child = owner.rpartition(".")
                    holder = self.get_submodule(parent) if parent else self
                    setattr(holder, child, finalize(owner, getattr(holder, child)))

        for name, tensor in self._expand_experts(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            name = self.param_name(name)
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self.FUSED:
                fused, idx = self.FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                group = pending.setdefault(target, {})
                group[idx] = tensor
                if len(group) == (3 if fused == "qkv_proj" else 2):
                    parts = [group[i] for i in sorted(group)]
                    if all(isinstance(p, RawBlocks) for p in parts):
                        fused_tensor = RawBlocks.cat(parts)
                    elif all(isinstance(p, (Int4Blocks, RawBlocks)) for p in parts):
                        fused_tensor = Int4Blocks.cat([p.blocks() if isinstance(p, RawBlocks) else p for p in parts])
                    else:  # int4 blocks beside other formats (Gemma's q/k Q5_0, v Q8_0): one dense weight
                        fused_tensor = torch.cat([_dense(p, params[target].dtype) for p in parts], dim=0)
                    del pending[target], group, parts
                    put(target, fused_tensor)
                continue
            if name not in params:
                raise ValueError(f"Unexpected weight {name!r} in checkpoint.")
            put(name, tensor)
        missing = set(params) - loaded
        if pending or missing:
            raise ValueError(f"Checkpoint is missing weights: {sorted(missing | set(pending))[:8]}")

    @staticmethod
    def _expand_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """transformers 5's fused expert tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
        as one tensor per expert, the layout checkpoints are saved in."""
        for name, tensor in weights:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                base, _, proj = name.rpartition(".")
                for e in range(tensor.shape[0]):
                    yield f"{base}.{e}.{proj}.weight", tensor[e]
            else:
                yield name, tensor

    def _copy(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor | Int4Blocks,
              device: torch.device | str) -> None:
        """Put a checkpoint tensor into its parameter; int4 blocks kept as stored and lazy rows are set aside in
        `native_weights` instead."""
        p = params[name]
        if tuple(p.shape) != tuple(tensor.shape):
            raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}.")
        if isinstance(tensor, (Int4Blocks, RawBlocks, LazyRows)):
            self.native_weights[name] = tensor
        elif p.is_meta:
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            setattr(module, attr, nn.Parameter(tensor.to(device, p.dtype), requires_grad=False))
        else:
            p.data.copy_(tensor)


Finalize = Callable[[str, nn.Module], nn.Module]


def _process(name: str, module: nn.Module) -> nn.Module:
    if isinstance(module, Linear):
        module.process_weights_after_loading()
    return module


def _dense(w: torch.Tensor | Int4Blocks | RawBlocks, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, RawBlocks):
        return w.dequantize().to(dtype)
    if isinstance(w, Int4Blocks):
        from pagedlm.model.quant import dequantize_int4

        return dequantize_int4(w.qweight, w.scale, w.mins, 32).to(dtype)
    return w
