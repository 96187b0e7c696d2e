"""The linear layers a loaded model runs: Hugging Face's separate projections merged into
one matrix where they read the same input (q/k/v, gate/up), stored the way the device
multiplies fastest.

Checkpoints and the model's `nn.Linear` modules keep Hugging Face's names and layouts (so
weights load unchanged); `MergedLinear.merge` then takes their weights once, after loading.
On CPU the merged weight is kept transposed (`[in, out]`, contiguous): MKL multiplies
`x @ W` markedly faster than `x @ W.T` at decode batch sizes (2x at 16 rows); on
accelerators it stays `[out, in]` for `F.linear`. Every output column is the same dot
product either way, so merging does not change results beyond float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# Rows for which MKL's packed weights beat a plain matrix product (measured on the model's
# whole weight set: up to 30% faster at 2..16 rows, even at 32, slower from 64 and at 1).
PACKED_ROWS = range(2, 33)


class MergedLinear(nn.Module):
    """`x -> cat([x @ W_i.T + b_i for each merged layer], -1)` in one matrix product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]):
        super().__init__()
        self.transposed = weight.device.type == "cpu"
        stored = weight.t().contiguous() if self.transposed else weight.contiguous()
        self.weight = nn.Parameter(stored, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sizes = tuple(sizes)
        self.out_features = sum(self.sizes)
        self.packed: torch.Tensor | None = None

    def pack(self) -> int:
        """Also keep MKL's packed copy of the weight (CPU, float32) for decode-sized batches;
        returns its bytes (0 when packing does not apply)."""
        if not self.transposed or self.weight.dtype != torch.float32 or not _has_mkl_packing():
            return 0
        with torch.no_grad():
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(
                self.weight.t().contiguous(), max(PACKED_ROWS)
            )
        return self.packed.numel() * self.packed.element_size()

    @classmethod
    def merge(cls, layers: Sequence[nn.Linear]) -> MergedLinear:
        """One layer computing every given layer's output, concatenated in order."""
        weights = [layer.weight.detach() for layer in layers]
        with_bias = [layer.bias is not None for layer in layers]
        if any(with_bias) and not all(with_bias):
            raise ValueError("merged layers must all have a bias or none")
        bias = torch.cat([layer.bias.detach() for layer in layers]) if all(with_bias) else None
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return cls(weight, bias, [w.shape[0] for w in weights])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:  # the model's activations are flat [tokens, features] already
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if self.packed is not None and rows in PACKED_ROWS:
            # The packed layout does not depend on the row count it was made for.
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight.t(), self.bias, rows)
        return (
            torch.mm(x, self.weight)
            if self.bias is None
            else torch.addmm(self.bias, x, self.weight)
        )

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged output as one view per original layer."""
        return self(x).split(self.sizes, dim=-1)


def _has_mkl_packing() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
