"""The KV cache an engine allocates, and the memory report it logs: one function (`plan_kv_cache`) for the engine
and for `pagedlm memory`, which shows the same plan without loading the model."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from pagedlm.config import EngineConfig, ModelConfig, parse_bytes
from pagedlm.kvcache.block_manager import max_tokens_per_seq
from pagedlm.kvcache.kv_cache import KVCacheSpec
from pagedlm.kvcache.memory import MemoryReport
from pagedlm.kvcache.sizing import AvailableMemory, DraftSizing, KVBudget, KVSizing, check_peak, plan_kv_budget

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCachePlan:
    """`num_blocks` device blocks (and `num_cpu_blocks` host blocks for swapping), sequences of up to
    `max_model_len` tokens, the budget that chose them and the report of it all. `refusal` says why the engine
    would not start with this configuration on this machine (only with `report_refusal`)."""

    num_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    budget: KVBudget
    report: MemoryReport
    refusal: str = ""


def plan_kv_cache(config: EngineConfig, model: ModelConfig, spec: KVCacheSpec, weight_bytes: int,
                  memory: AvailableMemory, device_type: str = "cpu", report_refusal: bool = False,
                  draft: DraftSizing | None = None) -> KVCachePlan:
    """The KV cache for `config` on a device with `memory` available (kvcache/sizing.py), with the weights taking
    `weight_bytes`, and beside it a draft model's (`draft`, speculative decoding: `budget.draft_blocks`).
    `max_model_len` is the model's context unless set (more than the context is refused), capped (with a warning)
    at the longest sequence the cache holds. Raises ValueError, before anything is allocated, for
    what cannot fit; with `report_refusal` (`pagedlm memory`) it plans as if the available memory were unknown
    instead, and the report names the refusal."""
    context = model.context_length
    sizing = KVSizing.for_config(config, spec, context, weight_bytes, device_type, draft)
    refusal = ""
    try:
        _check_context(config, context)
        budget = plan_kv_budget(sizing, memory)
        if budget.num_blocks < 1:
            raise ValueError("The KV cache budget holds no block; raise kv_cache_memory or num_kv_blocks.")
    except ValueError as e:
        if not report_refusal:
            raise
        budget, refusal = replace(plan_kv_budget(sizing, AvailableMemory(None, "unknown")), available=memory), str(e)
    max_len = sizing.max_model_len
    if not refusal:
        check_peak(budget)
        capacity = max_tokens_per_seq(spec.sliding_windows, spec.block_size, budget.num_blocks,
                                      config.max_num_batched_tokens)
        if max_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache capacity (%d tokens); capping it.", max_len,
                           capacity)
            max_len = capacity
    num_cpu_blocks = spec.num_blocks_for(parse_bytes(config.swap_space)) if config.preemption_mode == "swap" else 0
    report = MemoryReport.build(model, spec, budget.num_blocks, num_cpu_blocks, max_len, weight_bytes=weight_bytes,
                                budget=budget, refusal=refusal, draft=draft)
    return KVCachePlan(budget.num_blocks, num_cpu_blocks, max_len, budget, report, refusal)


def check_fits(config: EngineConfig, model: ModelConfig, spec: KVCacheSpec, weight_bytes: int,
               memory: AvailableMemory) -> None:
    """Raise `plan_kv_cache`'s refusal (without its report or warnings) where the KV cache `config` asks for cannot
    fit beside `weight_bytes` of weights on a CPU with `memory` available. The engine calls it before the weights
    load, with their size estimated from the checkpoint, so that what this machine cannot hold is refused in a
    moment rather than after the load; `plan_kv_cache` decides again with the loaded weights' own size."""
    _check_context(config, model.context_length)
    plan_kv_budget(KVSizing.for_config(config, spec, model.context_length, weight_bytes), memory)


def _check_context(config: EngineConfig, context: int) -> None:
    if config.max_model_len is not None and config.max_model_len > context:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {context}.")
