"""The block plan of the Triton fused mixture-of-experts (`kernels.fused_moe`), in plain torch:
a batch's (token, expert) assignments grouped by expert, each expert's group padded to whole
`block_m` blocks, so every block of rows belongs to one expert and one grouped-GEMM program
can multiply it by that expert's weights (vLLM's `moe_align_block_size`, written as torch
ops; no triton here, so it is unit-tested on its own).

Assignment `a = t * k + j` is token `t`'s `j`-th choice, `topk_ids.reshape(-1)[a]`. Only
experts in `[expert_offset, expert_offset + num_local_experts)` (this rank's range under
expert parallelism) are planned, as local ids `e - expert_offset`; the other assignments
appear nowhere (their rows stay zero).

CUDA-graph safe: nothing is read back to the host; every output's size depends only on the
shapes (`max_blocks`), blocks past the last used one have expert -1 and padding slots hold
the sentinel `num_assignments`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockPlan(NamedTuple):
    sorted_ids: torch.Tensor  # int32 [max_blocks * block_m]: assignment per row, or sentinel
    block_experts: torch.Tensor  # int32 [max_blocks]: local expert of each block, -1: unused
    num_assignments: int  # T * k, the sentinel value


def max_blocks(num_assignments: int, num_local_experts: int, block_m: int) -> int:
    """An upper bound on the blocks any routing of `num_assignments` can need: `m` non-empty
    experts holding `c_e` rows need `sum ceil(c_e / block_m) <= (N + m (block_m - 1)) /
    block_m` blocks, with `m <= min(E, N)`."""
    used = min(num_local_experts, num_assignments)
    return (num_assignments + used * (block_m - 1)) // block_m


def align_block_size(
    topk_ids: torch.Tensor,
    block_m: int,
    num_local_experts: int,
    expert_offset: int = 0,
) -> BlockPlan:
    """The plan (module docstring) of `topk_ids` `[T, k]` (any integer dtype). Within an
    expert, rows keep assignment order (token order, then choice order)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    if block_m < 1 or num_local_experts < 1:
        raise ValueError(f"block_m ({block_m}) and num_local_experts must be >= 1")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long() - expert_offset
    count = flat.numel()
    blocks = max_blocks(count, num_local_experts, block_m)
    sorted_ids = torch.full((blocks * block_m + 1,), count, dtype=torch.int32, device=device)
    if count == 0:
        return BlockPlan(sorted_ids[:-1], torch.full((0,), -1, dtype=torch.int32, device=device), 0)
    local = (flat >= 0) & (flat < num_local_experts)
    # Assignments of other ranks' experts form one last group, `num_local_experts`, dropped.
    key = torch.where(local, flat, num_local_experts)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[-1] = 0
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)  # grouped by expert, assignment order within
    sorted_key = key[order]
    rank = torch.arange(count, device=device) - start[sorted_key]  # place within its group
    dest = padded_start[sorted_key] + rank
    dest = torch.where(sorted_key < num_local_experts, dest, blocks * block_m)  # the dump slot
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    # Block b starts at row b * block_m: its expert is the first whose padded group ends
    # after it (empty experts end where they start, so they are never chosen).
    block_starts = torch.arange(blocks, device=device) * block_m
    experts = torch.searchsorted(padded_end[:-1], block_starts, right=True)
    block_experts = torch.where(experts < num_local_experts, experts, -1).to(torch.int32)
    return BlockPlan(sorted_ids[:-1], block_experts, count)
