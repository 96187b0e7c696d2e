"""The worker's paged KV cache: one pre-allocated tensor of fixed-size blocks.

Layout: a single tensor `data` of shape
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (the `2` is K then V).
Block-major order makes one block (every layer, both K and V) a single contiguous region, so
moving a set of blocks between workers is one gather into one message and one scatter on the
other side. The per-layer K and V caches that attention kernels use are strided views
(`data[:, layer, 0]`, `data[:, layer, 1]`) of shape `[num_blocks, block_size, kv_heads,
head_dim]`; writing through them writes `data`.

KV groups (`common.kv_groups`, a model mixing windowed and full layers): a block then holds
`num_layers` *slots*, one per layer of one group, and `layer_slots` gives each of this
stage's layers its (group, slot); a layer's caches are views of its slot, and its attention
reads its group's block table. Without groups, layer i is slot i of every block.

The memory may come from outside (`storage`: the shared-memory pool of `kv_shared`). A
forward pass reports each layer it finishes (`layer_written`) to `on_layer_written`, if
set: the shared pool's progress header, which same-host peers stream from. Before a layer
reads the cache it calls `on_layer_needed`, if set: a KV connector's loads still under way
(`kv_connector.wait_for_layer_load`); a pass that runs no Python per layer (a replayed CUDA
graph) asks for every layer first (`all_layers_needed`).

The cache does not allocate blocks to sequences; the scheduler owns block ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class KvCache:
    """Block pool for all layers' keys and values."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        zeroed: bool = True,
        storage: torch.Tensor | None = None,
        layer_slots: tuple[tuple[int, int], ...] | None = None,
        num_groups: int = 1,
    ) -> None:
        """`zeroed=False` leaves memory untouched until used (swap space); `storage`, a
        uint8 tensor of exactly the pool's bytes, is used as the pool (not cleared).
        `num_layers`: slots per block; `layer_slots`: each layer's (group, slot) of the
        model's `num_groups` KV groups (None: layer i in slot i, one group)."""
        for name, value in (
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KvCache {name} must be a positive integer, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"KvCache dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        if layer_slots is None:
            layer_slots = tuple((0, i) for i in range(num_layers))
        if any(not (0 <= g < num_groups and 0 <= i < num_layers) for g, i in layer_slots):
            raise ValueError(f"KvCache layer_slots {layer_slots} out of range")
        self.layer_slots = layer_slots
        self.num_groups = num_groups
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.on_layer_written: Callable[[int], None] | None = None
        self.on_layer_needed: Callable[[int], None] | None = None  # by this stage's index
        if storage is not None:
            expected = num_blocks * self.bytes_per_block(
                block_size, num_layers, num_kv_heads, head_dim, dtype
            )
            if storage.dtype != torch.uint8 or storage.numel() != expected:
                raise ValueError(f"KvCache storage must be {expected} uint8 elements")
            self.data = storage.view(dtype).view(shape)
            return
        make = torch.zeros if zeroed else torch.empty
        self.data = make(shape, dtype=dtype, device=self.device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        if not 0 <= index < len(self.layer_slots):
            raise ValueError(f"layer index {index} out of range [0, {len(self.layer_slots)})")
        slot = self.layer_slots[index][1]
        return self.data[:, slot, 0], self.data[:, slot, 1]

    def group_of(self, index: int) -> int:
        """The KV group of this stage's layer `index` (whose block table it reads)."""
        return self.layer_slots[index][0]

    def layer_written(self, index: int) -> None:
        """A forward pass finished layer `index` (its KV is in the pool)."""
        if self.on_layer_written is not None:
            self.on_layer_written(index)

    def all_layers_needed(self) -> None:
        """A pass is about to read every layer at once (a replayed CUDA graph)."""
        if self.on_layer_needed is not None:
            for index in range(len(self.layer_slots)):
                self.on_layer_needed(index)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.bytes_per_block(
            self.block_size, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype
        )

    @staticmethod
    def bytes_per_block(
        block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size

    @classmethod
    def num_blocks_for_bytes(
        cls,
        memory_bytes: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in `memory_bytes`."""
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be non-negative, got {memory_bytes}")
        return memory_bytes // cls.bytes_per_block(
            block_size, num_layers, num_kv_heads, head_dim, dtype
        )

    def gather_blocks(
        self, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy the given blocks into a contiguous uint8 tensor `[len(block_ids), block_bytes]`
        (into `out` when given: a reused staging buffer of exactly that shape)."""
        index = self._index(block_ids, unique=False)
        if out is not None:
            expected = (len(index), self.block_bytes)
            if out.dtype != torch.uint8 or tuple(out.shape) != expected:
                raise ValueError(f"gather target must be uint8 {expected}, got {out.shape}")
            typed = out.view(self.dtype).view(len(index), *self.data.shape[1:])
            torch.index_select(self.data, 0, index, out=typed)
            return out
        blocks = self.data.index_select(0, index).contiguous()
        elements_per_block = self.data[0].numel()
        return blocks.view(len(index), elements_per_block).view(torch.uint8)

    def scatter_blocks(self, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Write a `gather_blocks` payload into the given blocks (the inverse of gather)."""
        index = self._index(block_ids, unique=True)
        expected = (len(index), self.block_bytes)
        if payload.dtype != torch.uint8:
            raise ValueError(f"KV payload must be uint8, got {payload.dtype}")
        if tuple(payload.shape) != expected:
            raise ValueError(f"KV payload shape {tuple(payload.shape)} != expected {expected}")
        if len(index) == 0:
            return
        values = payload.to(self.device).contiguous().view(len(index), *self.bytes.shape[1:])
        self._put(index, block_ids, values)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], source: KvCache | None = None) -> None:
        """Copy whole blocks: `self[dst] = source[src]` for each (src, dst) pair.

        `source` defaults to this cache (copy-on-write); another cache of the same geometry
        moves blocks between device and swap space or the offload tier. Destinations must be
        distinct. Between two CPU caches each run of consecutive blocks is copied straight
        (no gathered temporary: the tier's 64-block loads of SmolLM2 took 2.2 ms instead of
        4.3, `bench.kv_layer_loads`); within one cache the gather comes first, as a
        destination may be another pair's source.
        """
        if not pairs:
            return
        source = self if source is None else source
        if source.data.shape[1:] != self.data.shape[1:] or source.dtype != self.dtype:
            raise ValueError("block copies need caches of the same geometry and dtype")
        src = source._index([p[0] for p in pairs], unique=False)
        dst_ids = [p[1] for p in pairs]
        dst = self._index(dst_ids, unique=True)
        if source is not self and self.device.type == source.device.type == "cpu":
            for s, d, n in block_runs([p[0] for p in pairs], dst_ids):
                self.bytes[d : d + n].copy_(source.bytes[s : s + n])
            return
        self._put(dst, dst_ids, source.bytes.index_select(0, src).to(self.device))

    def _put(self, index: torch.Tensor, block_ids: Sequence[int], values: torch.Tensor) -> None:
        """`self.bytes[block_ids[i]] = values[i]` (distinct, checked ids; `index` is them as
        a tensor). On CPU, `index_copy_` of the uint8 view ran at ~3.7 GB/s (17.9 ms for 64
        MiB, the largest part of a cross-host transfer); one `copy_` per run of consecutive
        blocks streams at memory speed (3.1 ms). Elsewhere one kernel, however scattered."""
        if self.device.type != "cpu":
            self.bytes.index_copy_(0, index, values)
            return
        for start, block, count in block_runs(range(len(index)), [int(b) for b in block_ids]):
            self.bytes[block : block + count].copy_(values[start : start + count])

    @property
    def bytes(self) -> torch.Tensor:
        """The pool as raw bytes, `[num_blocks, ..., head_dim * element size]`: whole-block
        copies go through it (torch has no CPU `index_copy_` for float8)."""
        return self.data.view(torch.uint8)

    def _index(self, block_ids: Sequence[int], unique: bool) -> torch.Tensor:
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(
                f"block ids {bad[:8]} out of range [0, {self.num_blocks})"
                + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
            )
        if unique and len(set(ids)) != len(ids):
            raise ValueError("block ids must be distinct when scattering")
        return torch.tensor(ids, dtype=torch.long, device=self.device)


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both block lists go up by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
