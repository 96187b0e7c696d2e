"""Micro-batches of a pipeline-parallel step, so that its stages overlap: the step's
requests are cut into up to P contiguous groups with about equal token counts (a request
is never split), and each stage runs them one after another — the first stage sends group
k's hidden states on without waiting and starts group k + 1 while the next stage computes
group k. The last stage's outputs, concatenated in order, are the step's rows as one pass
would give them.

One pass lets a request read KV that another request of the same step writes (a prefix-
cache hit on blocks planned in this step: each layer writes every new token's KV before
anyone attends). Micro-batches only keep that true when the writer runs in the same or an
earlier micro-batch, so a step where a request reads a block a later micro-batch writes
runs as one (`keeps_writers_first`). `split_requests` and `keeps_writers_first` are pure
Python."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.models.attention_metadata import (
    AttentionMetadata,
    SequenceSlice,
    build_attention_metadata,
)


def split_requests(tokens_per_request: Sequence[int], parts: int) -> list[range]:
    """Contiguous ranges of request indices, at most `parts` of them, none empty, covering
    every request in order, cut where the running token count passes each k/parts of the
    total."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    count = len(tokens_per_request)
    parts = min(parts, count)
    if parts <= 1:
        return [range(count)] if count else []
    total = sum(tokens_per_request)
    groups, start, running = [], 0, 0
    for index, tokens in enumerate(tokens_per_request):
        running += tokens
        left_after = count - index - 1  # requests after this one
        cuts_left = parts - len(groups) - 1  # cuts still to make after this group
        if cuts_left == 0:
            break
        due = running * parts >= total * (len(groups) + 1)
        if (due or left_after == cuts_left) and left_after >= cuts_left:
            groups.append(range(start, index + 1))
            start = index + 1
    groups.append(range(start, count))
    return groups


def keeps_writers_first(
    slices: Sequence[SequenceSlice],
    groups: Sequence[range],
    block_size: int,
    num_kv_groups: int = 1,
) -> bool:
    """No request reads (attends over, before its new tokens) a block that a request of a
    later group writes this step (block tables of `num_kv_groups` interleaved KV groups)."""
    n = num_kv_groups
    writer_group: dict[int, int] = {}
    for g, group in enumerate(groups):
        for i in group:
            s = slices[i]
            first, last = s.num_computed_tokens // block_size, (s.seq_len - 1) // block_size
            for block in s.block_ids[first * n : (last + 1) * n]:
                writer_group[block] = max(g, writer_group.get(block, g))
    for g, group in enumerate(groups):
        for i in group:
            s = slices[i]
            read = -(-s.num_computed_tokens // block_size)
            if any(writer_group.get(b, -1) > g for b in s.block_ids[: read * n]):
                return False
    return True


def pipelined_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    slices: Sequence[SequenceSlice],
    kv_cache,
) -> torch.Tensor | None:
    """One step of a pipeline stage in micro-batches: the last stage's hidden states for
    every row (None on the other stages, which sent theirs on). `positions` and `meta` are
    the whole step's (used as they are when it runs as one pass)."""
    stage = model.stage
    groups = split_requests([s.num_new_tokens for s in slices], stage.size)
    if len(groups) > 1 and not keeps_writers_first(
        slices, groups, meta.block_size, kv_cache.num_groups
    ):
        groups = [range(len(slices))]  # one pass: a reader comes before its writer
    if len(groups) <= 1:
        hidden = model(ids, positions, kv_cache, meta)
        stage.wait_sends()
        return hidden
    outputs, row = [], 0
    for group in groups:
        part = slices[group.start : group.stop]
        rows = sum(s.num_new_tokens for s in part)
        part_positions, part_meta = build_attention_metadata(
            part, meta.block_size, ids.device, kv_cache.num_groups
        )
        outputs.append(model(ids[row : row + rows], part_positions, kv_cache, part_meta))
        row += rows
    stage.wait_sends()  # the tensors sent stay alive until the next stage has them
    if outputs[0] is None:
        return None
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
