"""The fused-MoE block plan (`kernels/moe_align.py`, plain torch): assignments grouped by
expert, each group padded to whole blocks, other ranks' experts left out, sizes by shape
only, and no host reads (CUDA-graph safe)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_align import align_block_size, max_blocks
from tests.gpu.graph_safety import no_host_reads


def check_plan(topk_ids: torch.Tensor, block_m: int, num_local: int, offset: int = 0) -> None:
    """Every invariant the kernels rely on, against a Python walk over the assignments."""
    plan = align_block_size(topk_ids, block_m, num_local, offset)
    flat = topk_ids.reshape(-1).tolist()
    count = len(flat)
    blocks = max_blocks(count, num_local, block_m)
    assert plan.num_assignments == count
    assert plan.sorted_ids.dtype == plan.block_experts.dtype == torch.int32
    assert plan.sorted_ids.shape == (blocks * block_m,)
    assert plan.block_experts.shape == (blocks,)
    ids = plan.sorted_ids.view(blocks, block_m).tolist()
    experts = plan.block_experts.tolist()
    expected_rows = []  # per local expert, its assignments in order
    for local in range(num_local):
        expected_rows.append([a for a, e in enumerate(flat) if e - offset == local])
    used = [e for e in experts if e >= 0]
    assert experts == used + [-1] * (blocks - len(used))  # unused blocks only at the end
    assert used == sorted(used)
    for local, rows in enumerate(expected_rows):
        own = [ids[b] for b, e in enumerate(experts) if e == local]
        assert len(own) == -(-len(rows) // block_m)  # padded to whole blocks, no more
        got = [a for block in own for a in block]
        assert got == rows + [count] * (len(got) - len(rows))  # in order, then sentinels
    for b in range(len(used), blocks):
        assert ids[b] == [count] * block_m


def test_hand_worked_plan() -> None:
    # Expert 0: assignment 1; expert 1: 3; expert 2: 0 and 2. Four rows per block.
    plan = align_block_size(torch.tensor([[2, 0], [2, 1]]), 4, 3)
    s = 4  # the sentinel
    assert plan.sorted_ids.tolist() == [1, s, s, s, 3, s, s, s, 0, 2, s, s]
    assert plan.block_experts.tolist() == [0, 1, 2]


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (37, 4, 2), (20, 6, 1)])
def test_random_routings(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    check_plan(ids, block_m, experts)
    check_plan(ids.int(), block_m, experts)


def test_few_experts_and_empty_ones() -> None:
    ids = torch.tensor([[1, 4], [4, 1], [4, 1]] * 7)  # experts 0, 2, 3, 5: no tokens
    check_plan(ids, 4, 6)
    plan = align_block_size(ids, 4, 6)
    assert set(plan.block_experts.tolist()) == {1, 4, -1}


@pytest.mark.parametrize(("offset", "num_local"), [(0, 3), (3, 3), (6, 2), (7, 1)])
def test_expert_range_leaves_other_experts_out(offset: int, num_local: int) -> None:
    gen = torch.Generator().manual_seed(offset)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(23)])
    check_plan(ids, 4, num_local, offset)


def test_range_nobody_routes_to() -> None:
    plan = align_block_size(torch.tensor([[0, 1], [1, 0]]), 16, 2, expert_offset=5)
    assert (plan.block_experts == -1).all() and (plan.sorted_ids == 4).all()


def test_bound_is_reached() -> None:
    """One token per expert: every expert's block is all padding but one row."""
    ids = torch.arange(6).reshape(3, 2)
    assert max_blocks(6, 6, 16) == 6
    plan = align_block_size(ids, 16, 6)
    assert plan.block_experts.tolist() == list(range(6))
    counts = [17, 17, 17, 13]  # 2 + 2 + 2 + 1 blocks: the bound for 64 rows over 4 experts
    ids = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)]).reshape(32, 2)
    assert max_blocks(64, 4, 16) == 7
    assert (align_block_size(ids, 16, 4).block_experts >= 0).all()


def test_no_assignments() -> None:
    plan = align_block_size(torch.zeros(0, 2, dtype=torch.long), 16, 4)
    assert plan.sorted_ids.numel() == 0 and plan.block_experts.numel() == 0


def test_no_host_reads() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [3, 3]])
    with no_host_reads():
        align_block_size(ids, 16, 3, expert_offset=1)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="topk_ids"):
        align_block_size(torch.zeros(4, dtype=torch.long), 16, 4)
    with pytest.raises(ValueError, match="block_m"):
        align_block_size(torch.zeros(4, 2, dtype=torch.long), 0, 4)
