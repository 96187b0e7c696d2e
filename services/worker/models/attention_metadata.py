"""Per-forward attention metadata: which cache slot each new token writes, and which blocks
each sequence reads.

A forward pass flattens the new tokens of S sequences into one `[T]` batch (prefill chunks and
single-token decodes mixed). `build_attention_metadata` turns each sequence's share
(`SequenceSlice`) into the flat positions plus an `AttentionMetadata` that is passed
explicitly down to every attention layer; nothing is stored globally.

KV groups (`common.kv_groups`): a sequence's block ids are then its flat, interleaved table
(entry `i * num_groups + g` is group g's i-th block), and the metadata holds one
`AttentionMetadata` per group (`groups`), each with that group's slots and tables; a layer
attends through its group's (`for_group`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a forward pass."""

    num_computed_tokens: int  # tokens whose KV is already in the cache
    num_new_tokens: int  # tokens computed in this pass (>= 1)
    block_ids: Sequence[int]  # the sequence's block table (must cover computed + new tokens)
    # Its request's prompt length (0: unknown, as if every token were generated): sets the
    # rope length of its prompt tokens (`AttentionMetadata.rope_lengths`).
    num_prompt_tokens: int = 0

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
    """Everything attention needs about the batch, built once per forward pass.

    Host lists serve the torch path; the device tensors serve the Triton kernels (and stay
    at fixed addresses inside CUDA graphs, where `max_seq_len` is the captured bound).
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    query_start_loc: list[int]  # len S + 1: sequence i owns tokens [loc[i], loc[i + 1])
    seq_lens: list[int]  # len S: num_computed + num_new
    block_size: int
    query_start_loc_t: torch.Tensor | None = None  # int32 [S + 1] on the device
    seq_lens_t: torch.Tensor | None = None  # int32 [S] on the device
    max_query_len: int = 0
    max_seq_len: int = 0
    # Split-KV partitions for the decode kernel (None = let the kernel choose).
    decode_num_splits: int | None = None
    # What the attention backend planned for this pass (`AttentionBackend.prepare`).
    backend_plan: object | None = None
    # int64 [T] on the device: each token's rope length, max(prompt length, position + 1),
    # the length of the transformers `generate` forward call that computes it (used by the
    # length-dependent RoPE types, `models/rope.py`; None: position + 1).
    rope_lengths: torch.Tensor | None = None
    # KV groups: each group's metadata (this one's fields are group 0's); (): one group.
    groups: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group `group` attends through."""
        return self.groups[group] if self.groups else self

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def last_token_indices(self) -> list[int]:
        """Row of each sequence's last new token in the flat batch."""
        return [end - 1 for end in self.query_start_loc[1:]]


def build_attention_metadata(
    seqs: Sequence[SequenceSlice],
    block_size: int,
    device: torch.device | str,
    num_groups: int = 1,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Return (positions int64 [T], metadata) for a batch of sequence slices."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not seqs:
        raise ValueError("cannot build attention metadata for an empty batch")
    computed = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
    new = np.fromiter((s.num_new_tokens for s in seqs), np.int64, len(seqs))
    seq_lens = computed + new
    needed = -(-seq_lens // block_size)
    tables = np.zeros((num_groups, len(seqs), int(needed.max())), dtype=np.int32)
    for i, seq in enumerate(seqs):
        if len(seq.block_ids) < needed[i] * num_groups:
            raise ValueError(
                f"sequence {i}: {seq_lens[i]} tokens need {needed[i]} blocks of {block_size}"
                + (f" in each of {num_groups} KV groups" if num_groups > 1 else "")
                + f", block table has {len(seq.block_ids)}"
            )
        if num_groups == 1:
            tables[0, i, : needed[i]] = seq.block_ids[: needed[i]]
            continue
        ids = seq.block_ids[: needed[i] * num_groups]
        for group in range(num_groups):
            tables[group, i, : needed[i]] = ids[group::num_groups]
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(new, out=query_start_loc[1:])
    owner = np.repeat(np.arange(len(seqs)), new)
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[owner] + computed[owner]
    prompt = np.fromiter((s.num_prompt_tokens for s in seqs), np.int64, len(seqs))
    rope_lengths = np.maximum(prompt[owner], positions + 1)

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    shared = dict(
        query_start_loc=query_start_loc.tolist(),
        seq_lens=seq_lens.tolist(),
        block_size=block_size,
        query_start_loc_t=to_device(query_start_loc.astype(np.int32)),
        seq_lens_t=to_device(seq_lens.astype(np.int32)),
        max_query_len=int(new.max()),
        max_seq_len=int(seq_lens.max()),
        rope_lengths=to_device(rope_lengths),
    )
    metas = []
    for group_tables in tables:
        slots = group_tables[owner, positions // block_size].astype(np.int64) * block_size
        slots += positions % block_size
        metas.append(
            AttentionMetadata(
                slot_mapping=to_device(slots), block_tables=to_device(group_tables), **shared
            )
        )
    if num_groups == 1:
        return to_device(positions), metas[0]
    return to_device(positions), dataclasses.replace(metas[0], groups=tuple(metas))
