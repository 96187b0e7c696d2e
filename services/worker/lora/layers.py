"""Batched multi-LoRA in the model's linear layers (S-LoRA / Punica's idea in plain torch):
every projection holds, for each adapter slot, its LoRA A and B stacked, and a forward pass
adds `x @ A_s.T @ B_s.T` (scaling folded into B) to the rows of the tokens whose request
uses slot s, one gathered segment per adapter present in the step; base-model tokens are
untouched. A merged layer (q/k/v, gate/up) keeps one A of its parts' ranks side by side and
a block-diagonal B, so each segment is two matrix products whatever the adapter targets.

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
        self.max_rank = max_rank
        weight = base.weight
        in_features = weight.shape[0] if base.transposed else weight.shape[1]
        shape_a = (num_slots, len(parts) * max_rank, in_features)
        self.lora_a = torch.zeros(shape_a, dtype=weight.dtype, device=weight.device)
        shape_b = (num_slots, base.out_features, len(parts) * max_rank)
        self.lora_b = torch.zeros(shape_b, dtype=weight.dtype, device=weight.device)

    def set_slot(self, slot: int, adapter: LoraAdapter | None, layer: int) -> None:
        """Slot `slot` holds `adapter`'s update of this projection in model layer `layer`
        (zero where it does not target a part; None empties the slot)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if adapter is None:
            return
        row = 0
        for i, part in enumerate(self.parts):
            pair = adapter.weights.get((layer, part))
            if pair is not None:
                a, b = pair
                if a.shape[1] != self.lora_a.shape[2] or b.shape[0] != self.sizes[i]:
                    raise ValueError(
                        f"LoRA adapter {adapter.name!r}: layer {layer} {part} has A "
                        f"{tuple(a.shape)}, B {tuple(b.shape)}; the model's {part} is "
                        f"{self.sizes[i]} x {self.lora_a.shape[2]}"
                    )
                ranks = slice(i * self.max_rank, i * self.max_rank + adapter.rank)
                self.lora_a[slot, ranks] = a.to(self.lora_a.dtype)
                rows = slice(row, row + self.sizes[i])
                self.lora_b[slot, rows, ranks] = (b * adapter.scaling).to(self.lora_b.dtype)
            row += self.sizes[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self.context.segments:
            xa = torch.mm(x.index_select(0, rows), self.lora_a[slot].t())
            out.index_add_(0, rows, torch.mm(xa, self.lora_b[slot].t()))
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
