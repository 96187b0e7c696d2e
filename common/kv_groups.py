"""KV cache groups: which decoder layers share a block table, in the spirit of vLLM's
hybrid KV cache manager. Pure Python.

A model whose layers all attend the same way (all full, or all through one window) has one
group: every layer of a block belongs to it, as before. A model that mixes windowed and
full layers (Gemma 2/3, gpt-oss, Qwen2 with `max_window_layers`) gets several groups of at
most `size` layers each, all the same window within a group: each kind's layers, in order,
cut into runs of `size`, where `size` is the fewest layers any kind has (Gemma 2's 13
sliding + 13 full layers: two groups of 13; Gemma 3's 22 sliding + 4 full: one full group
of 4 and six sliding groups of 4, 4, 4, 4, 4 and 2).

A block then holds `size` layers (slots) of one group, and a request holds one block per
group for each `block_size` tokens. The scheduler keeps a request's blocks in one flat
table, interleaved: entry `i * num_groups + g` is group g's block for tokens
[i * block_size, (i + 1) * block_size). A windowed group's blocks that no later query
reads are freed (the null block takes their place) while the full groups keep theirs, so
at a context of many windows the windowed layers cost about a window of KV.

Layer `l` lives in the slot of its place in its group. A pipeline stage holds
its layers' slots only (`stage_slots`): its blocks have as many slots as its largest
group has layers there, group g's layers at slots from 0 in order.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvGroups:
    """Each group's window (None: full attention) and model layers, ascending."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.windows or len(self.windows) != len(self.layers):
            raise ValueError("KV groups need one window per group and at least one group")
        seen = sorted(layer for group in self.layers for layer in group)
        if seen != list(range(len(seen))) or any(not g for g in self.layers):
            raise ValueError(f"KV groups must cover layers 0..n-1 once each: {self.layers}")

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def size(self) -> int:
        """Slots (layers) per block: the largest group's layer count."""
        return max(len(g) for g in self.layers)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def group_of(self, layer: int) -> int:
        for group, layers in enumerate(self.layers):
            if layer in layers:
                return group
        raise ValueError(f"layer {layer} is in no KV group")

    def stage_slots(self, stage_layers: range) -> tuple[int, tuple[tuple[int, int], ...]]:
        """(slots per block, each stage layer's (group, slot)) for a pipeline stage holding
        `stage_layers`: group g's layers of the stage take slots 0, 1, ... in order."""
        placed: list[tuple[int, int]] = []
        used = [0] * self.num_groups
        for layer in stage_layers:
            group = self.group_of(layer)
            placed.append((group, used[group]))
            used[group] += 1
        return max(1, *used), tuple(placed)

    def slots_done(self, stage_layers: range, layers_done: int) -> int:
        """Leading slots of a stage's blocks whose every layer is among the stage's first
        `layers_done` layers (what a receiver may copy while the rest are computed)."""
        size, placed = self.stage_slots(stage_layers)
        last = [-1] * size  # the stage layer each slot waits for, at most
        for index, (_, slot) in enumerate(placed):
            last[slot] = max(last[slot], index)
        done = 0
        while done < size and last[done] < layers_done:
            done += 1
        return done


def kv_groups(layer_windows: tuple[int | None, ...] | None, num_layers: int,
              hybrid: bool = True) -> KvGroups:  # fmt: skip
    """The model's groups (module docstring). `hybrid=False` (vLLM's
    `--disable-hybrid-kv-cache-manager`): one group, windowed only when every layer is
    (by the widest window), as a model whose layers all attend alike."""
    everything = (tuple(range(num_layers)),)
    if layer_windows is None:
        return KvGroups((None,), everything)
    if len(layer_windows) != num_layers:
        raise ValueError(f"{len(layer_windows)} layer windows for {num_layers} layers")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1 or not hybrid:
        widest = None if None in kinds else max(w for w in kinds if w is not None)
        return KvGroups((widest,), everything)
    size = min(len(layers) for layers in kinds.values())
    windows: list[int | None] = []
    groups: list[tuple[int, ...]] = []
    for window, layers in sorted(kinds.items(), key=lambda kv: kv[1][0]):
        for start in range(0, len(layers), size):
            windows.append(window)
            groups.append(tuple(layers[start : start + size]))
    return KvGroups(tuple(windows), tuple(groups))
