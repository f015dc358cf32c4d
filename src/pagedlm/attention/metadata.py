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

    def suffix_query_start_loc(self, rows: list[int]) -> list[int] | None:
        """The offsets [num_seqs + 1] of `rows` (flat token indices, as the logits read them) where they are each
        sequence's last query tokens, in order: a prefill chunk's last token, a verify step's draft rows. None where
        they are not."""
        out, pos, end = [0], 0, 0
        for qlen in self.query_lens_list:
            end += qlen
            n = 0
            while pos + n < len(rows) and n < qlen and rows[pos + n] < end:
                n += 1
            if rows[pos:pos + n] != list(range(end - n, end)):
                return None
            pos += n
            out.append(pos)
        return out if pos == len(rows) else None
