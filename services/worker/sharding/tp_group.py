"""A rank's view of its tensor-parallel group: its rank and size, the sizes of the model
slices it holds (`common.parallel_plan` decides which), and the two collectives the
sharded model needs (sum across ranks after a row-parallel layer; gather of the
vocabulary-parallel logits). Size 1 is the plain model: no collective runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.model_config import ModelConfig
from common.parallel_plan import kv_heads_of_rank, q_heads_of_rank


@dataclass(frozen=True)
class TpGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None: the default group)
    expert_parallel: bool = False  # experts split whole over the ranks (MoE models)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside size {self.size}")

    def shard(self, config: ModelConfig) -> TpShard:
        return TpShard.of(config, self.rank, self.size, self.expert_parallel)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class TpShard:
    """What one rank holds of the model: query and KV heads, the MLP's inner slice, and the
    vocabulary rows of the embedding and LM head (padded to `vocab_per_rank` each). In a
    mixture-of-experts model, the experts `experts` (all of them, or with expert parallelism
    a contiguous 1/size of them, vLLM's linear placement) and of each the inner slice
    `expert_inner` (1/size of it, or all of it with expert parallelism)."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    inner: range
    vocab: range  # the rank's vocabulary rows, before padding
    vocab_per_rank: int
    vocab_size: int
    expert_inner: range = range(0)  # each held expert's inner slice (MoE models)
    experts: range = range(0)  # the experts this rank holds (MoE models)

    @classmethod
    def of(
        cls, config: ModelConfig, rank: int, size: int, expert_parallel: bool = False
    ) -> TpShard:
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if config.intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide intermediate_size "
                f"{config.intermediate_size}"
            )
        inner = config.intermediate_size // size
        experts, expert_inner = _expert_spans(config, rank, size, expert_parallel)
        per = -(-config.vocab_size // size)
        start = min(rank * per, config.vocab_size)
        return cls(
            rank, size,
            q_heads_of_rank(heads, kv, size, rank),
            kv_heads_of_rank(heads, kv, size, rank),
            range(rank * inner, (rank + 1) * inner),
            range(start, min(start + per, config.vocab_size)),
            per, config.vocab_size, expert_inner, experts,
        )  # fmt: skip


def _expert_spans(
    config: ModelConfig, rank: int, size: int, expert_parallel: bool
) -> tuple[range, range]:
    """(the experts rank `rank` holds, the slice of each one's inner dimension it holds)."""
    if config.moe is None:
        return range(0), range(0)
    count, inner = config.moe.num_experts, config.moe.expert_intermediate_size
    if expert_parallel:
        if count % size:
            raise ValueError(
                f"--enable-expert-parallel: tensor_parallel_size {size} must divide the "
                f"model's {count} experts"
            )
        per = count // size
        return range(rank * per, (rank + 1) * per), range(inner)
    if inner % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide the experts' intermediate size {inner}"
        )
    per = inner // size
    return range(count), range(rank * per, (rank + 1) * per)
