"""Admission: whether the engine could ever finish a request, even running alone.

The one formula, checked once per request by the InputProcessor (input_processor.py): a request
whose sequences (n, or beam_width with beam search) exceed max_num_seqs, or whose forked sequences at their
longest length do not fit in the KV cache together, would be preempted forever, so it is refused up front.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedlm.engine.errors import AdmissionError
from pagedlm.kvcache.block_manager import BlockManager, max_blocks_needed, max_tokens_per_seq
from pagedlm.sampling.params import SamplingParams


@dataclass(frozen=True)
class KVCacheShape:
    """The block manager's sizing facts: what the block arithmetic of admission needs."""

    block_size: int
    num_total_blocks: int
    sliding_windows: tuple[int | None, ...]  # one per KV cache group (None: full attention)
    max_chunk: int | None = None  # longest prefill chunk (max_num_batched_tokens)

    @classmethod
    def of(cls, block_manager: BlockManager, max_chunk: int | None = None) -> KVCacheShape:
        bm = block_manager
        return cls(bm.block_size, bm.num_total_blocks, tuple(bm.sliding_windows), max_chunk)

    def max_blocks_needed(self, prompt_len: int, total_len: int, width: int = 1) -> int:
        return max_blocks_needed(list(self.sliding_windows), self.block_size, prompt_len, total_len, width,
                                 self.max_chunk)

    def max_tokens_per_seq(self) -> int:
        return max_tokens_per_seq(list(self.sliding_windows), self.block_size, self.num_total_blocks, self.max_chunk)


@dataclass(frozen=True)
class AdmissionLimits:
    max_model_len: int
    max_num_seqs: int
    kv: KVCacheShape


def check_admission(prompt_lens: Iterable[int], params: SamplingParams, limits: AdmissionLimits) -> None:
    """Raise AdmissionError unless every prompt (of these lengths) with `params` could run to its end alone."""
    width = params.beam_width if params.use_beam_search else params.n
    if width > limits.max_num_seqs:
        name = "beam_width" if params.use_beam_search else "n"
        raise AdmissionError(f"{name}={width} exceeds this engine's max_num_seqs ({limits.max_num_seqs}).",
                             name)
    max_len, kv = limits.max_model_len, limits.kv
    max_new = max_len if params.max_tokens is None else params.max_tokens
    for prompt_len in prompt_lens:
        full_len = min(prompt_len + max(max_new, 1), max_len)
        need = kv.max_blocks_needed(prompt_len, full_len, width)
        if need > kv.num_total_blocks:
            raise AdmissionError(
                f"{width} sequences of up to {full_len} tokens do not fit in the KV cache ({kv.num_total_blocks} "
                f"blocks; one sequence fits at most {kv.max_tokens_per_seq()} tokens; these need {need}); "
                "lower n or max_tokens.", "n")
