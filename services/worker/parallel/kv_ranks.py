"""The receiving side of a KV pull between workers of different parallel layouts: the
model's KV geometry, and the pools of this worker's ranks (rank 0's own, the others' mapped
writable), each rank getting exactly the KV heads of the layers it holds, copied straight
from the source rank that holds them (`common.parallel_plan`). A rank's pool holds its
stage's layers only, numbered from 0. A single-process worker is the layout of size 1.

With KV groups (`common.kv_groups`) a pool's layer axis holds its stage's *slots*: the plan
then runs over slot ranges (`KvGeometry.stage_ranges`: stage k's slots follow stage k-1's),
which mean the same on both sides only when both split the model into the same stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.kv_groups import KvGroups
from common.parallel_plan import KvSlice, Layout, kv_heads_of_rank, kv_transfer_plan, layer_ranges


@dataclass(frozen=True)
class KvGeometry:
    num_heads: int
    num_kv_heads: int
    num_layers: int
    block_size: int
    head_dim: int
    groups: KvGroups | None = None  # KV groups of a hybrid model (None: one table)

    @property
    def hybrid(self) -> bool:
        return self.groups is not None and self.groups.is_hybrid

    def stage_ranges(self, pp: int) -> list[range]:
        """Each stage's range of the pools' layer axis: its model layers, or with KV groups
        its slots, numbered on from the previous stage's."""
        layers = layer_ranges(self.num_layers, pp)
        if not self.hybrid:
            return layers
        out, start = [], 0
        for stage in layers:
            slots = self.groups.stage_slots(stage)[0]
            out.append(range(start, start + slots))
            start += slots
        return out

    def axis_done(self, layers_done: int, pp: int) -> int:
        """How far along the layer axis (`stage_ranges`) a pool is final once the model's
        first `layers_done` layers are."""
        if not self.hybrid:
            return layers_done
        for stage, axis in zip(layer_ranges(self.num_layers, pp), self.stage_ranges(pp),
                               strict=True):  # fmt: skip
            if layers_done < stage.stop:
                done = max(0, layers_done - stage.start)
                return axis.start + self.groups.slots_done(stage, done)
        return self.stage_ranges(pp)[-1].stop

    def plan(self, src: Layout, dst: Layout) -> list[KvSlice]:
        """`kv_transfer_plan` over the pools' layer axes."""
        if self.hybrid and src.pp != dst.pp:
            raise ValueError(
                "KV groups (a model mixing sliding-window and full layers) move between "
                f"workers of the same pipeline_parallel_size only (here {src.pp} and "
                f"{dst.pp}); start the workers with --disable-hybrid-kv-cache-manager"
            )
        stages = (self.stage_ranges(src.pp), self.stage_ranges(dst.pp))
        return kv_transfer_plan(
            self.num_heads, self.num_kv_heads, self.num_layers, src, dst, stages
        )

    def block_shape(self, layout: Layout, rank: int) -> tuple[int, ...]:
        """One block of rank `rank`'s pool in a worker of `layout`."""
        stage, tp_rank = divmod(rank, layout.tp)
        heads = len(kv_heads_of_rank(self.num_heads, self.num_kv_heads, layout.tp, tp_rank))
        layers = len(self.stage_ranges(layout.pp)[stage])
        return (layers, 2, self.block_size, heads, self.head_dim)


@dataclass
class RankPools:
    geometry: KvGeometry
    layout: Layout
    pools: Sequence[torch.Tensor]  # rank r's pool data, [blocks, layers, 2, slot, heads, dim]
    _plans: dict[Layout, list[KvSlice]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.pools) != self.layout.world_size:
            raise ValueError(f"{len(self.pools)} rank pools for a worker of {self.layout}")

    def copy(
        self,
        src: Layout,
        sources: Sequence[torch.Tensor],
        runs: Sequence[tuple[int, int, int]],
        first_layer: int,
        end_layer: int,
    ) -> None:
        """The layer axis's [first_layer, end_layer) (`KvGeometry.stage_ranges`) of the runs'
        blocks, from the source worker's rank pools (`sources`, one per rank of layout
        `src`) into this worker's."""
        if src not in self._plans:
            self._plans[src] = self.geometry.plan(src, self.layout)
        src_first = [r.start for r in self.geometry.stage_ranges(src.pp)]
        dst_first = [r.start for r in self.geometry.stage_ranges(self.layout.pp)]
        for piece in self._plans[src]:
            start = max(first_layer, piece.layers.start)
            stop = min(end_layer, piece.layers.stop)
            if start >= stop:
                continue
            s0 = src_first[piece.src_rank // src.tp]  # the stages' first layers
            d0 = dst_first[piece.dst_rank // self.layout.tp]
            sh, dh, n = piece.src_head, piece.dst_head, len(piece.heads)
            layers = (range(start - s0, stop - s0), range(start - d0, stop - d0))
            heads = (range(sh, sh + n), range(dh, dh + n))
            copy_head_slice(
                self.pools[piece.dst_rank], sources[piece.src_rank], runs, layers, heads
            )


def copy_head_slice(
    dst: torch.Tensor,
    src: torch.Tensor,
    runs: Sequence[tuple[int, int, int]],
    layers: tuple[range, range],
    heads: tuple[range, range],
) -> None:
    """For every run, the (src, dst) `layers` and KV `heads` of the source blocks into the
    same layers and heads of the destination blocks, one strided copy per run. Pools are
    `[blocks, layers, 2, slot, heads, dim]`; layer and head indices are each pool's own."""
    if len(layers[0]) != len(layers[1]) or len(heads[0]) != len(heads[1]):
        raise ValueError(f"slice shapes differ: {layers} {heads}")
    sl, dl, sh, dh = (slice(r.start, r.stop) for r in (*layers, *heads))
    for s, d, n in runs:
        dst[d : d + n, dl, :, :, dh].copy_(src[s : s + n, sl, :, :, sh])
