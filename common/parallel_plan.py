"""Which rank of a tensor- or pipeline-parallel worker holds which attention heads and
layers, and how KV moves between two workers whose layouts differ. Pure Python.

Tensor parallelism of size t over a model with H query heads and K KV heads (vLLM's rule):
rank r computes query heads [r*H/t, (r+1)*H/t). With t <= K each rank holds K/t KV heads of
its own, [r*K/t, (r+1)*K/t); with t > K each KV head is replicated on t/K consecutive
ranks, rank r holding head r // (t/K), the one its query heads read. t must divide H, and
t and K must divide one another.

Pipeline parallelism of size p splits the decoder layers into p contiguous ranges, the
first `num_layers % p` stages one layer longer.

`kv_transfer_plan` says, for a prefill worker of layout (tp_a, pp_a) and a decode worker of
(tp_b, pp_b), which source rank sends which KV heads of which layers to which destination
rank: every destination rank gets exactly the heads and layers it holds, each once, straight
from a rank that holds them (no gather through rank 0). Where a head is replicated on
several source ranks the destinations are spread over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _check_tp(num_heads: int, num_kv_heads: int, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the model's {num_heads} attention heads"
        )
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's {num_kv_heads} KV heads must divide "
            f"one another"
        )


def q_heads_of_rank(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> range:
    _check_tp(num_heads, num_kv_heads, tp)
    per = num_heads // tp
    return range(rank * per, (rank + 1) * per)


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank `rank` holds (one replicated head when tp > num_kv_heads)."""
    _check_tp(num_heads, num_kv_heads, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tensor_parallel_size {tp}")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Each pipeline stage's decoder layers, in order."""
    if pp < 1 or pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size must be in [1, {num_layers}] (the model's layers), got {pp}"
        )
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class Layout:
    """A worker's parallel layout; rank = stage * tp + tp_rank (vLLM's order)."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallel sizes must be >= 1, got tp={self.tp} pp={self.pp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank


@dataclass(frozen=True)
class KvSlice:
    """One message of a transfer: `heads` of `layers` from source rank to destination rank.
    Head indices are the model's; `src_head`/`dst_head` are where the first of them sits
    among the heads the source / destination rank holds."""

    src_rank: int
    dst_rank: int
    layers: range
    heads: range
    src_head: int
    dst_head: int


def kv_transfer_plan(
    num_heads: int,
    num_kv_heads: int,
    num_layers: int,
    src: Layout,
    dst: Layout,
    stage_layers: tuple[Sequence[range], Sequence[range]] | None = None,
) -> list[KvSlice]:
    """`stage_layers`: each side's stages' ranges when a pool's layer axis is not the
    model's layers split evenly (KV groups' slots: `KvGeometry.stage_ranges`)."""
    if stage_layers is None:
        stage_layers = (layer_ranges(num_layers, src.pp), layer_ranges(num_layers, dst.pp))
    src_layers, dst_layers = stage_layers
    src_heads = [kv_heads_of_rank(num_heads, num_kv_heads, src.tp, r) for r in range(src.tp)]
    dst_heads = [kv_heads_of_rank(num_heads, num_kv_heads, dst.tp, r) for r in range(dst.tp)]
    plan: list[KvSlice] = []
    for d_stage, d_layers in enumerate(dst_layers):
        for s_stage, s_layers in enumerate(src_layers):
            layers = range(max(d_layers.start, s_layers.start), min(d_layers.stop, s_layers.stop))
            if not layers:
                continue
            for d_rank, wanted in enumerate(dst_heads):
                for head in wanted:
                    holders = [r for r, held in enumerate(src_heads) if head in held]
                    s_rank = holders[d_rank % len(holders)]  # spread replicas' readers
                    _add(
                        plan,
                        KvSlice(
                            src.rank(s_stage, s_rank),
                            dst.rank(d_stage, d_rank),
                            layers,
                            range(head, head + 1),
                            head - src_heads[s_rank].start,
                            head - wanted.start,
                        ),
                    )
    return plan


def _add(plan: list[KvSlice], piece: KvSlice) -> None:
    """Append, merging with the previous slice when the heads continue it."""
    if plan:
        last = plan[-1]
        if (
            (last.src_rank, last.dst_rank, last.layers) == (piece.src_rank, piece.dst_rank,
                                                             piece.layers)
            and last.heads.stop == piece.heads.start
            and last.src_head + len(last.heads) == piece.src_head
            and last.dst_head + len(last.heads) == piece.dst_head
        ):  # fmt: skip
            plan[-1] = KvSlice(
                last.src_rank, last.dst_rank, last.layers,
                range(last.heads.start, piece.heads.stop), last.src_head, last.dst_head,
            )  # fmt: skip
            return
    plan.append(piece)
