"""Micro-batches of a pipeline-parallel step, so that its stages overlap: the step's
requests are cut into up to P contiguous groups with about equal token counts (a request
is never split), and each stage runs them one after another — the first stage sends group
k's hidden states on without waiting and starts group k + 1 while the next stage computes
group k. The last stage's outputs, concatenated in order, are the step's rows as one pass
would give them. `split_requests` is pure Python."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata


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


def pipelined_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    slices: Sequence[SequenceSlice],
    kv_cache,
    block_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """One step of a pipeline stage in micro-batches: the last stage's hidden states for
    every row (None on the other stages, which sent theirs on)."""
    stage = model.stage
    outputs, row = [], 0
    for group in split_requests([s.num_new_tokens for s in slices], stage.size):
        part = slices[group.start : group.stop]
        rows = sum(s.num_new_tokens for s in part)
        positions, meta = build_attention_metadata(part, block_size, device)
        outputs.append(model(ids[row : row + rows], positions, kv_cache, meta))
        row += rows
    stage.wait_sends()  # the tensors sent stay alive until the next stage has them
    if outputs[0] is None:
        return None
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
