"""Batched multi-LoRA in the model's linear layers (S-LoRA / Punica's idea in plain torch):
every projection holds, for each adapter slot, its LoRA A and B, and a forward pass adds
`x @ A_s.T @ B_s.T` (scaling folded into B) to the rows of the tokens whose request uses
slot s, one gathered segment per adapter present in the step; base-model tokens are
untouched, and a projection the slot's adapter does not target costs nothing. A merged
layer (q/k/v, gate/up) keeps one A of its targeted parts' ranks side by side and a
block-diagonal B, so each segment is two matrix products (both stored transposed,
`[in, r]` and `[r, out]`: MKL's fast `x @ W` layout).

`LoraContext` says which slot each token of the pass uses (the runner sets it per pass);
`install_lora` wraps a loaded one-process model's projections."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from services.worker.lora.adapter import LoraAdapter
from services.worker.models.linear import MergedLinear

# Each wrapped projection of a decoder layer: (path in the layer, the HF modules it merges).
PROJECTIONS = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)


class LoraContext:
    """The current pass's adapter per token: `segments` = [(slot, token rows)]."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, torch.Tensor]] = []

    def set(self, token_slots: Sequence[int], device: torch.device | str = "cpu") -> None:
        """`token_slots[i]`: the slot of token i (-1: the base model)."""
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(token_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(i)
        self.segments = [
            (slot, torch.tensor(r, dtype=torch.long, device=device)) for slot, r in rows.items()
        ]

    def clear(self) -> None:
        self.segments = []


class LoraLinear(nn.Module):
    def __init__(
        self,
        base: MergedLinear,
        parts: tuple[str, ...],
        context: LoraContext,
        num_slots: int,
        max_rank: int,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.sizes = base.sizes
        self.out_features = base.out_features
        self.context = context
        self.num_slots = num_slots
        self.max_rank = max_rank
        weight = base.weight
        self.in_features = weight.shape[0] if base.transposed else weight.shape[1]
        # slot -> (A.T [in, r], scaling * B.T [r, out]) over the parts its adapter targets
        # (r: their ranks side by side; B block-diagonal); an untargeted slot adds nothing.
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_slot(self, slot: int, adapter: LoraAdapter, layer: int) -> None:
        """Slot `slot` holds `adapter`'s update of this projection in model layer `layer`
        (replacing what it held)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} outside 0..{self.num_slots - 1}")
        self.slots.pop(slot, None)
        a_parts, b_parts, col, rank = [], [], 0, 0
        for i, part in enumerate(self.parts):
            pair = adapter.weights.get((layer, part))
            if pair is not None:
                a, b = pair
                if a.shape[1] != self.in_features or b.shape[0] != self.sizes[i]:
                    raise ValueError(
                        f"LoRA adapter {adapter.name!r}: layer {layer} {part} has A "
                        f"{tuple(a.shape)}, B {tuple(b.shape)}; the model's {part} is "
                        f"{self.sizes[i]} x {self.in_features}"
                    )
                a_parts.append(a)
                b_parts.append((col, rank, b * adapter.scaling))
                rank += a.shape[0]
            col += self.sizes[i]
        if not a_parts:
            return
        weight = self.base.weight
        a_t = torch.cat(a_parts).t().contiguous().to(weight.device, weight.dtype)
        b_t = torch.zeros(rank, self.out_features, dtype=weight.dtype, device=weight.device)
        for start, offset, b in b_parts:
            b_t[offset : offset + b.shape[1], start : start + b.shape[0]] = b.t()
        self.slots[slot] = (a_t, b_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self.context.segments:
            weights = self.slots.get(slot)
            if weights is not None:
                a_t, b_t = weights
                out.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a_t), b_t))
        return out

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)


def install_lora(model, context: LoraContext, num_slots: int, max_rank: int) -> list:
    """Wrap every projection of the loaded model (after its projections are merged);
    returns [(model layer number, LoraLinear)] for filling slots."""
    if model.tp.size != 1:
        raise ValueError("LoRA with --tensor-parallel-size > 1 is not supported yet")
    if not model.merged:
        raise ValueError("install LoRA after the model's projections are merged")
    wrapped = []
    first = model.model.first_layer
    for index, layer in enumerate(model.model.layers):
        for path, parts in PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            lora = LoraLinear(getattr(owner, attr), parts, context, num_slots, max_rank)
            setattr(owner, attr, lora)
            wrapped.append((first + index, lora))
    return wrapped
