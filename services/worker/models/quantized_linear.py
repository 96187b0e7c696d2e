"""`QuantizedLinear`: `MergedLinear`'s twin (`linear.py`) for quantized layers kept packed on
the device (`quantized_weights.py`, the worker's `--quantized-matmul`), multiplied by the Triton
kernels of `kernels/quant_matmul.py`; and `install_quantized`, which merges a loaded
model's projections (q/k/v, gate/up, and each single one) with it, as
`LlamaForCausalLM.merge_projections` does with `MergedLinear`.

Merging concatenates the packed parts along the output dimension, which is exact: FP8
weights always (their scales become one per output row); GPTQ parts when they share the
input size, group count and grouping (`g_idx`, or none) and each part before the last
fills whole zero words (out a multiple of the pack). GPTQ parts that cannot be joined run
as separate matmuls whose outputs are concatenated. A merge mixing quantized and plain
layers (an FP8 `ignore` list) becomes a dense `MergedLinear`.

Offers what the model uses of `MergedLinear`: `forward` (any leading dims), `split`,
`sizes`, `out_features`, `in_features`, `bias`, `transposed` (False). Not supported: MKL
weight packing (`pack_weights` skips these layers) and LoRA adapters (LoRA needs a dense
`weight`, which raises a ValueError naming the limit); tensor parallelism is refused at
load (`quantized_weights.packed_matmul`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kernels.quant_matmul import fp8_matmul, gptq_matmul
from services.worker.models.linear import MergedLinear
from services.worker.models.quantized_weights import QuantizedWeight, gptq_groups

# Each merged projection of a decoder layer: (owner, merged name, the HF modules it merges).
MERGES = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


class GptqPack(nn.Module):
    """One GPTQ matrix as the kernel reads it (`g_idx` None: rows grouped in order)."""

    def __init__(self, qweight, qzeros, scales, g_idx, bits: int, group_size: int, offset: int):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.register_buffer("g_idx", g_idx)
        self.bits, self.group_size, self.zero_offset = bits, group_size, offset
        self.out_features, self.in_features = qweight.shape[1], qweight.shape[0] * 32 // bits

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gptq_matmul(
            x, self.qweight, self.qzeros, self.scales, self.g_idx,
            self.bits, self.group_size, self.zero_offset, bias,
        )  # fmt: skip

    def joinable(self, other: GptqPack) -> bool:
        """Whether `other`'s columns can follow this pack's in one matrix, exactly."""
        if self.g_idx is None or other.g_idx is None:
            same_groups = self.g_idx is None and other.g_idx is None
        else:
            same_groups = torch.equal(self.g_idx, other.g_idx)
        return (
            same_groups
            and self.out_features % (32 // self.bits) == 0
            and self.qweight.shape[0] == other.qweight.shape[0]
            and self.scales.shape[0] == other.scales.shape[0]
            and self.scales.dtype == other.scales.dtype
        )

    def join(self, other: GptqPack) -> GptqPack:
        return GptqPack(
            torch.cat([self.qweight, other.qweight], 1),
            torch.cat([self.qzeros, other.qzeros], 1),
            torch.cat([self.scales, other.scales], 1),
            self.g_idx, self.bits, self.group_size, self.zero_offset,
        )  # fmt: skip

    @classmethod
    def of(cls, weight: QuantizedWeight) -> GptqPack:
        """The pack of one checkpoint layer (shapes and `g_idx` checked; a `g_idx` that only
        restates the group size is dropped, for the kernel's in-order path)."""
        fmt, parts = weight.fmt, weight.parts
        qweight = parts["qweight"].to(torch.int32).contiguous()
        qzeros = parts["qzeros"].to(torch.int32).contiguous()
        scales = parts["scales"].contiguous()
        groups = gptq_groups(qweight, qzeros, scales, parts.get("g_idx"), fmt)
        num_in = groups.shape[0]
        size = fmt.group_size if fmt.group_size > 0 else num_in
        in_order = torch.arange(num_in, device=groups.device) // size
        g_idx = None if torch.equal(groups, in_order) else groups.to(torch.int32).contiguous()
        return cls(qweight, qzeros, scales, g_idx, fmt.bits, size, fmt.zero_offset)


class Fp8Pack(nn.Module):
    """One FP8 matrix `[out, in]` and its float32 scale (`[1]` or one per output row)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().reshape(-1).contiguous())
        self.out_features, self.in_features = weight.shape
        if self.scale.numel() not in (1, self.out_features):
            raise ValueError(f"weight_scale of {scale.numel()} values for {weight.shape[0]} rows")

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_matmul(x, self.weight, self.scale, bias)

    @classmethod
    def merged(cls, weights: Sequence[QuantizedWeight]) -> Fp8Pack:
        packs = [cls(w.parts["weight"], w.parts["weight_scale"]) for w in weights]
        if len(packs) == 1:
            return packs[0]
        scales = [p.scale.expand(p.out_features) for p in packs]
        return cls(torch.cat([p.weight for p in packs]), torch.cat(scales))


class QuantizedLinear(nn.Module):
    """`x -> cat([x @ W_i.T + b_i for each merged layer], -1)` over packed weights."""

    transposed = False  # no dense weight to lay out; kept for `MergedLinear`'s readers

    def __init__(self, packs: Sequence[nn.Module], bias: torch.Tensor | None, sizes):
        super().__init__()
        self.packs = nn.ModuleList(packs)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sizes = tuple(sizes)
        self.out_features = sum(self.sizes)
        self.in_features = self.packs[0].in_features
        if sum(p.out_features for p in self.packs) != self.out_features:
            raise ValueError(f"packed outputs do not add up to the merged sizes {self.sizes}")

    @property
    def weight(self) -> torch.Tensor:
        raise ValueError(
            "this layer's weights are quantized and packed for the Triton matmul: features "
            "that need a dense weight (LoRA adapters) are not supported with them; set "
            "quantized_matmul=dense (--quantized-matmul dense) to load the model dequantized"
        )

    @classmethod
    def merge(
        cls, weights: Sequence[QuantizedWeight], biases: Sequence[torch.Tensor | None]
    ) -> QuantizedLinear:
        """One layer computing every given quantized layer's output, concatenated in order."""
        bias = _merged_bias(biases)
        sizes = [w.shape[0] for w in weights]
        if weights[0].fmt.method == "fp8":
            return cls([Fp8Pack.merged(weights)], bias, sizes)
        packs: list[GptqPack] = []
        for weight in weights:
            pack = GptqPack.of(weight)
            if packs and packs[-1].joinable(pack):
                packs[-1] = packs[-1].join(pack)
            else:
                packs.append(pack)
        return cls(packs, bias, sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the model's activations are flat [tokens, features] already
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if len(self.packs) == 1:
            return self.packs[0](x, self.bias)
        outs, start = [], 0
        for pack in self.packs:
            stop = start + pack.out_features
            outs.append(pack(x, None if self.bias is None else self.bias[start:stop]))
            start = stop
        return torch.cat(outs, -1)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged output as one view per original layer."""
        return self(x).split(self.sizes, dim=-1)


def _merged_bias(biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    present = [b is not None for b in biases]
    if any(present) and not all(present):
        raise ValueError("merged layers must all have a bias or none")
    return torch.cat([b.detach() for b in biases]) if all(present) else None


def _merge(linears: Sequence[nn.Linear], quantized: Sequence[QuantizedWeight | None]):
    biases = [linear.bias for linear in linears]
    if all(q is not None for q in quantized):
        return QuantizedLinear.merge(quantized, biases)
    weights = [
        linear.weight.detach() if q is None else q.dense(linear.weight.dtype)
        for linear, q in zip(linears, quantized, strict=True)
    ]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    return MergedLinear(weight, _merged_bias(biases), [w.shape[0] for w in weights])


def install_quantized(model, packed: dict[str, QuantizedWeight]) -> None:
    """Merge the loaded model's projections (instead of `merge_projections`): layers in
    `packed` (by their `X.weight` name, on the model's device) become `QuantizedLinear`
    parts, the others dense `MergedLinear`s. The model is then merged."""
    if model.merged:
        raise ValueError("install quantized layers before the model's projections are merged")
    remaining = dict(packed)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for owner_name, merged_name, parts in MERGES:
                owner = getattr(layer, owner_name)
                prefix = f"model.layers.{index}.{owner_name}."
                linears = [getattr(owner, part) for part in parts]
                quantized = [remaining.pop(f"{prefix}{part}.weight", None) for part in parts]
                for part in parts:
                    delattr(owner, part)
                setattr(owner, merged_name, _merge(linears, quantized))
        if model.lm_head is not None:  # (a tied head: the embedding, never quantized)
            model.lm_head = _merge([model.lm_head], [remaining.pop("lm_head.weight", None)])
            if model.config.tie_word_embeddings and not model.stage.is_first:
                model.model.embed_tokens = None  # a last stage held it only for the head
    if remaining:
        raise ValueError(f"quantized layers the model does not have: {sorted(remaining)[:4]}")
    model.merged = True
