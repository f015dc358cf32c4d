"""The draft model of speculative decoding (`speculative_config` method draft_model), loaded in two halves so that
its memory counts in the engine's fit check before any KV cache is allocated: `load_draft_weights` checks its
tokenizer and loads its weights; the engine plans its KV cache beside the target's (`LoadedDraft.sizing`,
kvcache/sizing.py) and `LoadedDraft.start` allocates it, giving the DraftModel (spec/draft_model.py) that drafts."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from pagedlm.config import EngineConfig, ModelConfig
from pagedlm.engine.model_runner import Chunk, ModelRunner
from pagedlm.hub.loader import load_hf_config
from pagedlm.hub.registry import resolve_model
from pagedlm.hub.tokenizer import Tokenizer, load_tokenizer
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.kvcache.kv_cache import KVCacheSpec
from pagedlm.kvcache.sizing import DraftSizing, format_bytes
from pagedlm.model.plan import estimate_weight_bytes, plan_execution
from pagedlm.spec.draft_model import DraftModel

logger = logging.getLogger(__name__)


@dataclass
class LoadedDraft:
    """A draft model's weights (`runner`, holding `weight_bytes`), its KV cache not yet allocated. At most
    `max_seqs` sequences draft at once; `vocab_size` is the target's."""

    name: str
    runner: ModelRunner
    weight_bytes: int
    max_seqs: int
    num_speculative_tokens: int
    vocab_size: int
    max_num_batched_tokens: int

    @property
    def sizing(self) -> DraftSizing:
        return DraftSizing(self.name, self.runner.kv_spec, self.weight_bytes, self.max_seqs,
                           self.num_speculative_tokens)

    def start(self, num_blocks: int) -> DraftModel:
        """The draft model with a KV cache of `num_blocks` blocks (the engine's plan: `KVBudget.draft_blocks`)."""
        runner = self.runner
        runner.allocate_kv_cache(num_blocks, 0)
        bm = BlockManager(num_blocks, runner.block_size, sliding_windows=runner.kv_spec.sliding_windows)
        logger.info("Draft model %s: %s of weights; its KV cache: %d blocks (%s)", self.name,
                    format_bytes(self.weight_bytes), num_blocks, format_bytes(runner.kv_cache.gpu.nbytes))

        def forward(chunks, logits_index):
            return runner.execute([Chunk(*c) for c in chunks], logits_index)

        return DraftModel(forward, bm, self.vocab_size, runner.model_config.context_length,
                          self.max_num_batched_tokens)


def draft_config(config: EngineConfig, path: Path) -> EngineConfig:
    """The engine configuration the draft model (at `path`) runs with: the target's, with the draft's quantization."""
    return replace(config, model=str(path), quantization=config.speculative_config.quantization,
                   speculative_config=None, kv_cache_dir=None, num_kv_blocks=None)


def estimate_draft_sizing(config: EngineConfig) -> DraftSizing | None:
    """The draft model's memory without loading it (`pagedlm memory`): its weights estimated from its checkpoint's
    tensors in the format it runs them in (its own `quantization`), as the target's are there. None without a
    draft model."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    path = resolve_model(spec.model)
    cfg = draft_config(config, path)
    plan = plan_execution(cfg, path, measure=False)
    kv_spec = KVCacheSpec.for_model(ModelConfig.from_hf(load_hf_config(path)), config.block_size, plan.dtype,
                                    plan.kv_cache_dtype)
    return DraftSizing(spec.model, kv_spec, estimate_weight_bytes(path, plan),
                       min(config.max_num_seqs, spec.disable_by_batch_size), spec.num_speculative_tokens)


def load_draft_weights(config: EngineConfig, tokenizer: Tokenizer, vocab_size: int) -> LoadedDraft:
    """The draft model of `config.speculative_config`, its weights loaded with the target's `config` for the rest
    (dtype, device, block size, KV cache dtype). Raises ValueError, before loading its weights, if its tokenizer is
    not the target's (`tokenizer`, whose model has `vocab_size` rows of logits), and after, if it has fewer token
    embeddings than the target has logits."""
    spec = config.speculative_config
    path = resolve_model(spec.model)
    draft_vocab = load_tokenizer(path).hf.get_vocab()
    target_vocab = tokenizer.hf.get_vocab()
    if draft_vocab != target_vocab:
        differ = sum(draft_vocab.get(t) != i for t, i in target_vocab.items())
        raise ValueError(f"speculative_config: the draft model {spec.model!r} has another tokenizer than the target "
                         f"({len(draft_vocab)} tokens against {len(target_vocab)}, {differ} of the target's tokens "
                         "missing or with other ids); a draft model must share the target's tokenizer.")
    cfg = draft_config(config, path)
    runner = ModelRunner(cfg, path, plan_execution(cfg, path))
    if runner.model_config.vocab_size < vocab_size:
        raise ValueError(f"speculative_config: the draft model {spec.model!r} has {runner.model_config.vocab_size} "
                         f"token embeddings, fewer than the target's {vocab_size}: it could not read every token.")
    return LoadedDraft(spec.model, runner, runner.weight_bytes(), min(config.max_num_seqs, spec.disable_by_batch_size),
                       spec.num_speculative_tokens, vocab_size, config.max_num_batched_tokens)
