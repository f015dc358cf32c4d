"""The batch layout every attention backend reads."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """A flat batch of new tokens from several sequences (prefill chunks and decode tokens mixed).

    Sequence `i` contributes the query tokens `query_start_loc[i]:query_start_loc[i+1]`; they are the last
    `query_lens[i]` tokens of its `seq_lens[i]` tokens, whose K/V live in the blocks `block_tables[i]`
    (padded with 0 past the sequence's last block). `slot_mapping[t]` is where token t's K/V are written:
    `block * block_size + offset`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens_list: list[int]
    query_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
