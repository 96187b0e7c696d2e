"""Batched multi-LoRA in the model's linear layers (S-LoRA / Punica's idea in plain torch):
every projection holds, for each adapter slot, its LoRA A and B, and a forward pass adds
`x @ A_s.T @ B_s.T` (scaling folded into B) to the rows of the tokens whose request uses
slot s, one gathered segment per adapter present in the step; base-model tokens are
untouched, and a projection the slot's adapter does not target costs nothing. A merged
layer (q/k/v, gate/up) keeps one A of its targeted parts' ranks side by side and a
block-diagonal B, so each segment is two matrix products (both stored transposed,
`[in, r]` and `[r, out]`: MKL's fast `x @ W` layout).

On CUDA the same update runs as two Triton launches per projection for all slots at once
(`kernels.lora_triton`): each slot's weights are then kept stacked and zero-padded,
`[num_slots, in, R]` / `[num_slots, R, out]` with R = max_rank * parts, plus each slot's rank
(0: untargeted or empty, skipped), and the context keeps the pass's per-token slots on the
device. On CPU the per-slot segment path above stays (measured faster there).

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
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # kernels.lora_triton's


class LoraContext:
    """The current pass's adapter per token: `segments` = [(slot, token rows)] for the torch
    path, `per_token()` = (slot per token, tokens sorted by slot) for the Triton path. The
    pass's own device gets its form at `set` (once per pass, not per layer); the other is
    built on first use."""

    def __init__(self) -> None:
        self._token_slots: list[int] = []
        self._device = torch.device("cpu")
        self._segments: list[tuple[int, torch.Tensor]] | None = []
        self._per_token: tuple[torch.Tensor, torch.Tensor] | None = None
        self.active = False  # any token uses a slot

    def set(self, token_slots: Sequence[int], device: torch.device | str = "cpu") -> None:
        """`token_slots[i]`: the slot of token i (-1: the base model)."""
        self._token_slots = list(token_slots)
        self._device = torch.device(device)
        self._segments = self._per_token = None
        self.active = any(slot >= 0 for slot in self._token_slots)
        if self._device.type == "cpu":
            self._segments = self._build_segments()
        else:
            self._per_token = self._build_per_token()

    def clear(self) -> None:
        self._token_slots = []
        self._segments, self._per_token, self.active = [], None, False

    @property
    def segments(self) -> list[tuple[int, torch.Tensor]]:
        if self._segments is None:
            self._segments = self._build_segments()
        return self._segments

    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 `[T]` slot of each token, int32 `[T]` token indices sorted by slot)."""
        if self._per_token is None:
            self._per_token = self._build_per_token()
        return self._per_token

    def _build_segments(self) -> list[tuple[int, torch.Tensor]]:
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(self._token_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(i)
        return [
            (slot, torch.tensor(r, dtype=torch.long, device=self._device))
            for slot, r in rows.items()
        ]

    def _build_per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._token_slots
        order = sorted(range(len(slots)), key=slots.__getitem__)  # stable
        both = torch.tensor([slots, order], dtype=torch.int32).to(self._device)  # one copy
        return both[0], both[1]


class LoraLinear(nn.Module):
    def __init__(
        self,
        base: MergedLinear,
        parts: tuple[str, ...],
        context: LoraContext,
        num_slots: int,
        max_rank: int,
        use_triton: bool | None = None,
    ) -> None:
        """`use_triton`: run the Triton kernels (default: when the weight is on CUDA in a
        dtype they support; tests force them on CPU tensors, under Triton's interpreter)."""
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
        if use_triton is None:
            use_triton = weight.device.type == "cuda" and weight.dtype in TRITON_DTYPES
        self.use_triton = use_triton
        # slot -> (A.T [in, r], scaling * B.T [r, out]) over the parts its adapter targets
        # (r: their ranks side by side; B block-diagonal); an untargeted slot adds nothing.
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if use_triton:  # the same, stacked over slots and zero-padded to every part's rank
            rank = max_rank * len(parts)
            like = dict(dtype=weight.dtype, device=weight.device)
            self.lora_a = torch.zeros(num_slots, self.in_features, rank, **like)
            self.lora_b = torch.zeros(num_slots, rank, self.out_features, **like)
            self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32, device=weight.device)

    def set_slot(self, slot: int, adapter: LoraAdapter, layer: int) -> None:
        """Slot `slot` holds `adapter`'s update of this projection in model layer `layer`
        (replacing what it held)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} outside 0..{self.num_slots - 1}")
        weights = self._slot_weights(adapter, layer)
        if not self.use_triton:
            self.slots.pop(slot, None)
            if weights is not None:
                self.slots[slot] = weights
            return
        rank = 0 if weights is None else weights[0].shape[1]
        if rank > self.lora_a.shape[2]:
            raise ValueError(f"LoRA adapter {adapter.name!r}: rank {rank} over the parts of "
                             f"{'/'.join(self.parts)} > {self.lora_a.shape[2]} (max_rank "
                             f"{self.max_rank} per part)")  # fmt: skip
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if weights is not None:
            self.lora_a[slot, :, :rank] = weights[0]
            self.lora_b[slot, :rank] = weights[1]
        self.slot_ranks[slot] = rank

    def _slot_weights(
        self, adapter: LoraAdapter, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A.T [in, r], scaling * B.T [r, out]) of `adapter` here; None if untargeted."""
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
            return None
        weight = self.base.weight
        a_t = torch.cat(a_parts).t().contiguous().to(weight.device, weight.dtype)
        b_t = torch.zeros(rank, self.out_features, dtype=weight.dtype, device=weight.device)
        for start, offset, b in b_parts:
            b_t[offset : offset + b.shape[1], start : start + b.shape[0]] = b.t()
        return a_t, b_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.use_triton:
            if self.context.active:
                token_slots, order = self.context.per_token()
                flat = out.view(-1, self.out_features)
                _add_lora()(
                    x.reshape(-1, self.in_features),
                    flat,
                    token_slots,
                    self.lora_a,
                    self.lora_b,
                    token_order=order,
                    slot_ranks=self.slot_ranks,
                )
            return out
        for slot, rows in self.context.segments:
            weights = self.slots.get(slot)
            if weights is not None:
                a_t, b_t = weights
                out.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a_t), b_t))
        return out

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)


def _add_lora():
    """`kernels.lora_triton.add_lora`, imported on first use (CPU servers never load Triton)."""
    from kernels.lora_triton import add_lora

    return add_lora


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
