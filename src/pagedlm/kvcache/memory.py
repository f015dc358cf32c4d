"""KV memory arithmetic made visible: bytes per token, blocks, tokens that fit, concurrency.

Sliding-window layers only keep their last `window` tokens (plus a partly used block), so their cost per sequence
is bounded; only the full-attention layers grow with the sequence. Concurrency is counted for decoding sequences;
a prefill chunk of n tokens briefly needs ceil(n / block_size) more blocks in every sliding-window group.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedlm.config import ModelConfig
from pagedlm.kvcache.block_manager import max_blocks_needed, max_tokens_per_seq
from pagedlm.kvcache.kv_cache import KVCacheSpec
from pagedlm.kvcache.sizing import DraftSizing, KVBudget
from pagedlm.kvcache.sizing import format_bytes as _fmt_bytes


@dataclass
class MemoryReport:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    scale_bytes: int  # per token and kv head, for int8/fp8 caches (0 otherwise)
    kv_bytes_per_token: int  # all layers
    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    full_bytes_per_token: int  # grows with every token of a sequence
    sliding_bytes_per_token: int  # only for the tokens in the window
    sliding_bytes_per_seq: int  # bound for one decoding sequence, whatever its length
    block_size: int
    layers_per_block: int
    num_groups: int  # KV cache groups (block tables per sequence)
    bytes_per_block: int
    num_blocks: int
    num_cpu_blocks: int
    kv_cache_bytes: int
    tokens_capacity: int  # the longest single sequence that fits
    max_model_len: int
    max_concurrency: float  # decoding sequences of max_model_len that fit at once
    max_concurrency_without_freeing: float  # the same if sliding-window blocks were kept
    weight_params: int = 0  # parameters of the checkpoint (every expert of a MoE model)
    weight_bytes: int = 0  # the weights as held for the run (or parameters x dtype size where not loaded)
    num_experts: int = 0
    moe_layers: int = 0
    kv_budget: str = ""  # how the budget was chosen (kvcache/sizing.py; empty where no budget was planned)
    kv_demand_bytes: int = 0
    kv_cap_bytes: int = 0
    overhead_bytes: int = 0
    expected_peak_bytes: int = 0  # weights + KV cache + overhead
    memory_available: int | None = None
    memory_source: str = ""
    refusal: str = ""  # why the engine would refuse this configuration on this machine (`pagedlm memory`)
    draft_model: str = ""  # speculative decoding's draft model, with its own weights and KV cache ("": none)
    draft_weight_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    draft_num_blocks: int = 0
    draft_bytes_per_block: int = 0
    draft_kv_cache_bytes: int = 0
    draft_max_seqs: int = 0  # sequences that draft at once

    @classmethod
    def build(cls, cfg: ModelConfig, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int,
              max_model_len: int, weight_bytes: int | None = None, budget: KVBudget | None = None,
              refusal: str = "", draft: DraftSizing | None = None) -> MemoryReport:
        windows = spec.sliding_windows
        per_layer = 2 * spec.num_kv_heads * spec.entry_dim * spec.element_size
        full_layers = sum(len(g.layers) for g in spec.groups if g.sliding_window is None)
        sliding_layers = spec.num_layers - full_layers
        sliding = [w for w in windows if w is not None]
        blocks_per_seq = max_blocks_needed(windows, spec.block_size, max_model_len, max_model_len, 1, 1)
        sliding_blocks = max_blocks_needed(sliding, spec.block_size, max_model_len, max_model_len, 1, 1)
        planned = {} if budget is None else dict(
            kv_budget=budget.choice, kv_demand_bytes=budget.demand, kv_cap_bytes=budget.cap,
            overhead_bytes=budget.overhead_bytes, expected_peak_bytes=budget.expected_peak,
            memory_available=budget.available.bytes, memory_source=budget.available.source, refusal=refusal)
        if draft is not None and budget is not None:
            planned.update(draft_model=draft.model, draft_weight_bytes=draft.weight_bytes,
                           draft_kv_bytes_per_token=draft.spec.bytes_per_token, draft_num_blocks=budget.draft_blocks,
                           draft_bytes_per_block=budget.draft_bytes_per_block,
                           draft_kv_cache_bytes=budget.draft_kv_bytes, draft_max_seqs=draft.max_seqs)
        return cls(
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            dtype=str(spec.dtype).removeprefix("torch."), dtype_bytes=spec.element_size,
            scale_bytes=spec.entry_dim - spec.head_dim,
            kv_bytes_per_token=spec.bytes_per_token, full_layers=full_layers, sliding_layers=sliding_layers,
            sliding_window=max(sliding) if sliding else None, full_bytes_per_token=full_layers * per_layer,
            sliding_bytes_per_token=sliding_layers * per_layer,
            sliding_bytes_per_seq=sliding_blocks * spec.bytes_per_block, block_size=spec.block_size,
            layers_per_block=spec.layers_per_block, num_groups=len(spec.groups), bytes_per_block=spec.bytes_per_block,
            num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, kv_cache_bytes=num_blocks * spec.bytes_per_block,
            tokens_capacity=max_tokens_per_seq(windows, spec.block_size, num_blocks, 1),
            max_model_len=max_model_len, max_concurrency=num_blocks / blocks_per_seq,
            max_concurrency_without_freeing=num_blocks / (len(windows) * -(-max_model_len // spec.block_size)),
            weight_params=cfg.num_parameters(),
            weight_bytes=cfg.num_parameters() * spec.element_size if weight_bytes is None else weight_bytes,
            num_experts=cfg.num_experts if cfg.is_moe else 0, moe_layers=sum(cfg.moe_layers or [])
            if cfg.is_moe else 0, **planned)

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        entry = f"{self.head_dim} head_dim x {self.dtype_bytes} B ({self.dtype})"
        if self.scale_bytes:
            entry = f"({entry} + {self.scale_bytes} B scale)"
        experts = (f", all {self.num_experts} experts of {self.moe_layers} MoE layers" if self.num_experts else "")
        lines = [
            "KV cache memory report",
            f"  weights            : {self.weight_params / 1e6:,.1f}M parameters{experts} = "
            f"{_fmt_bytes(self.weight_bytes)}",
            f"  KV bytes per token : 2 x {self.num_layers} layers x {self.num_kv_heads} kv_heads x "
            f"{entry} = {self.kv_bytes_per_token:,} B ({_fmt_bytes(self.kv_bytes_per_token)})",
        ]
        if self.sliding_layers:
            lines += [
                (f"    full attention   : {self.full_layers} layers = {self.full_bytes_per_token:,} B per token, "
                 "for every token"),
                (f"    sliding window   : {self.sliding_layers} layers = {self.sliding_bytes_per_token:,} B per token, "
                 f"for the last {self.sliding_window:,} tokens only: at most {_fmt_bytes(self.sliding_bytes_per_seq)} "
                 "per sequence"),
            ]
        block = f"{self.block_size} tokens = {_fmt_bytes(self.bytes_per_block)}"
        if self.num_groups > 1:
            block = (f"{self.block_size} tokens x {self.layers_per_block} layers = {_fmt_bytes(self.bytes_per_block)} "
                     f"({self.num_groups} block tables per sequence)")
        concurrency = f"{self.max_concurrency:.2f} sequences of {self.max_model_len:,} tokens"
        if self.sliding_layers:
            concurrency += f" ({self.max_concurrency_without_freeing:.2f} if sliding-window blocks were kept)"
        lines += [
            f"  block size         : {block}",
            f"  KV cache           : {self.num_blocks:,} blocks = {_fmt_bytes(self.kv_cache_bytes)}"
            + (f" (+ {self.num_cpu_blocks:,} host swap blocks)" if self.num_cpu_blocks else ""),
            f"  tokens that fit    : {self.tokens_capacity:,}" + (" in one sequence" if self.sliding_layers else ""),
            f"  max concurrency    : {concurrency}",
        ]
        if self.draft_model:
            lines.append(f"  draft model        : {self.draft_model}: weights {_fmt_bytes(self.draft_weight_bytes)}, "
                         f"its KV cache {self.draft_num_blocks:,} blocks of {_fmt_bytes(self.draft_bytes_per_block)} "
                         f"= {_fmt_bytes(self.draft_kv_cache_bytes)} ({self.draft_kv_bytes_per_token:,} B per token, "
                         f"{self.draft_max_seqs} drafting sequences)")
        if self.kv_budget:
            available = ("unknown" if self.memory_available is None else
                         f"{_fmt_bytes(self.memory_available)} ({self.memory_source})")
            draft = (f" + draft weights {_fmt_bytes(self.draft_weight_bytes)} + draft KV cache "
                     f"{_fmt_bytes(self.draft_kv_cache_bytes)}" if self.draft_model else "")
            lines += [
                f"  KV budget          : {self.kv_budget}",
                f"  memory available   : {available}",
                f"  expected peak      : {_fmt_bytes(self.expected_peak_bytes)} = weights "
                f"{_fmt_bytes(self.weight_bytes)} + KV cache {_fmt_bytes(self.kv_cache_bytes)}{draft} + overhead "
                f"{_fmt_bytes(self.overhead_bytes)}",
            ]
        if self.refusal:
            lines.append(f"  on this machine    : the engine would refuse to start: {self.refusal}")
        return "\n".join(lines)
