"""Per-forward attention metadata: which cache slot each new token writes, and which blocks
each sequence reads.

A forward pass flattens the new tokens of S sequences into one `[T]` batch (prefill chunks and
single-token decodes mixed). `build_attention_metadata` turns each sequence's share
(`SequenceSlice`) into the flat positions plus an `AttentionMetadata` that is passed
explicitly down to every attention layer; nothing is stored globally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a forward pass."""

    num_computed_tokens: int  # tokens whose KV is already in the cache
    num_new_tokens: int  # tokens computed in this pass (>= 1)
    block_ids: Sequence[int]  # the sequence's block table (must cover computed + new tokens)

    def __post_init__(self) -> None:
        if self.num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {self.num_computed_tokens}")
        if self.num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {self.num_new_tokens}")
        block_ids = tuple(int(b) for b in self.block_ids)
        if any(b < 0 for b in block_ids):
            raise ValueError(f"block ids must be non-negative, got {list(block_ids)}")
        object.__setattr__(self, "block_ids", block_ids)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + self.num_new_tokens


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about the batch, built once per forward pass."""

    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    query_start_loc: list[int]  # len S + 1: sequence i owns tokens [loc[i], loc[i + 1])
    seq_lens: list[int]  # len S: num_computed + num_new
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def last_token_indices(self) -> list[int]:
        """Row of each sequence's last new token in the flat batch."""
        return [end - 1 for end in self.query_start_loc[1:]]


def build_attention_metadata(
    seqs: Sequence[SequenceSlice], block_size: int, device: torch.device | str
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Return (positions int64 [T], metadata) for a batch of sequence slices."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not seqs:
        raise ValueError("cannot build attention metadata for an empty batch")
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    tables: list[list[int]] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    for i, seq in enumerate(seqs):
        needed = -(-seq.seq_len // block_size)
        if len(seq.block_ids) < needed:
            raise ValueError(
                f"sequence {i}: {seq.seq_len} tokens need {needed} blocks of {block_size}, "
                f"block table has {len(seq.block_ids)}"
            )
        table = list(seq.block_ids[:needed])
        pos = torch.arange(seq.num_computed_tokens, seq.seq_len, dtype=torch.long)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        positions.append(pos)
        slots.append(blocks * block_size + pos % block_size)
        tables.append(table)
        query_start_loc.append(query_start_loc[-1] + seq.num_new_tokens)
        seq_lens.append(seq.seq_len)
    max_blocks = max(len(t) for t in tables)
    padded = torch.zeros((len(tables), max_blocks), dtype=torch.int32)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=padded.to(device),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_size=block_size,
    )
    return torch.cat(positions).to(device), meta
