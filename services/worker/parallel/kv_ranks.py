"""The receiving side of a KV pull between workers of different tensor-parallel layouts:
the model's KV geometry, this worker's layout, and the pools of its ranks (rank 0's own,
the others' mapped writable), so that each rank gets exactly the KV heads it holds,
copied straight from the source rank that holds them (`common.parallel_plan`). A
single-process worker is the layout of size 1: one slice, every head."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.parallel_plan import KvSlice, Layout, kv_heads_of_rank, kv_transfer_plan
from services.worker.kv_shared import copy_head_slice


@dataclass(frozen=True)
class KvGeometry:
    num_heads: int
    num_kv_heads: int
    num_layers: int
    block_size: int
    head_dim: int

    def block_shape(self, tp: int, rank: int) -> tuple[int, ...]:
        """One block of rank `rank`'s pool in a worker of `tp` ranks."""
        heads = len(kv_heads_of_rank(self.num_heads, self.num_kv_heads, tp, rank))
        return (self.num_layers, 2, self.block_size, heads, self.head_dim)


@dataclass
class RankPools:
    geometry: KvGeometry
    tp: int
    pools: Sequence[torch.Tensor]  # rank r's pool data, [blocks, layers, 2, slot, heads, dim]
    _plans: dict[int, list[KvSlice]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.pools) != self.tp:
            raise ValueError(f"{len(self.pools)} rank pools for tensor_parallel_size {self.tp}")

    def plan(self, src_tp: int) -> list[KvSlice]:
        if src_tp not in self._plans:
            g = self.geometry
            self._plans[src_tp] = kv_transfer_plan(
                g.num_heads, g.num_kv_heads, g.num_layers, Layout(src_tp), Layout(self.tp)
            )
        return self._plans[src_tp]

    def copy(
        self,
        sources: Sequence[torch.Tensor],
        runs: Sequence[tuple[int, int, int]],
        first_layer: int,
        end_layer: int,
    ) -> None:
        """Layers [first_layer, end_layer) of the runs' blocks, from the source worker's
        rank pools (`sources`, one per rank) into this worker's."""
        for piece in self.plan(len(sources)):
            layers = range(max(first_layer, piece.layers.start), min(end_layer, piece.layers.stop))
            if not layers:
                continue
            n = len(piece.heads)
            copy_head_slice(
                self.pools[piece.dst_rank],
                sources[piece.src_rank],
                runs,
                (layers, layers),
                (
                    range(piece.src_head, piece.src_head + n),
                    range(piece.dst_head, piece.dst_head + n),
                ),
            )
