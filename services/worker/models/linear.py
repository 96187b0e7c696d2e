"""The linear layers a loaded model runs: Hugging Face's separate projections merged into
one matrix where they read the same input (q/k/v, gate/up), stored the way the device
multiplies fastest.

Checkpoints and the model's `nn.Linear` modules keep Hugging Face's names and layouts (so
weights load unchanged); `MergedLinear.merge` then takes their weights once, after loading.
On CPU the merged weight is kept transposed (`[in, out]`, contiguous): MKL multiplies
`x @ W` markedly faster than `x @ W.T` at decode batch sizes (2x at 16 rows); on
accelerators it stays `[out, in]` for `F.linear`. Every output column is the same dot
product either way, so merging does not change results beyond float rounding. A CPU
float32 layer can also keep a packed copy (MKL's, oneDNN's or Tandem's, whichever `cpu_gemm`
measured faster on this CPU) and use it at the row counts its plan names; Tandem's format
also keeps a weight made of GGUF Q4_1/Q8_0 blocks as those blocks for the smallest products
(`compact_panels.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models import cpu_gemm
from services.worker.models.compact_panels import BLOCK_PANEL_ROWS
from services.worker.models.gemm_plan import PLAIN, GemmPlan


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
        self.plan: GemmPlan = PLAIN  # which row counts take `packed`, in which format
        # Tandem's Q4_1/Q8_0 block panels of a weight made of such blocks (GGUF), for the
        # smallest products (compact_panels.py)
        self.blocks: torch.Tensor | None = None

    @property
    def packable(self) -> bool:
        return self.transposed and self.weight.dtype == torch.float32

    def pack(self, plan: GemmPlan) -> int:
        """Also keep the plan's packed copy of the weight (CPU, float32) for the row counts it
        serves; returns its bytes (0 when packing does not apply)."""
        if not self.packable or plan.packed_format is None:
            return 0
        with torch.no_grad():
            self.packed = cpu_gemm.pack(self.weight, plan.packed_format)
            self.blocks = cpu_gemm.block_panels(self.weight, plan.packed_format)
        self.plan = plan
        extra = 0 if self.blocks is None else self.blocks.numel()
        return cpu_gemm.packed_bytes(self.packed, self.weight, plan.packed_format) + extra

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
        if self.blocks is not None and x.shape[0] <= BLOCK_PANEL_ROWS:
            return torch.ops.tandem_cpu.packed_linear(x, self.blocks, self.out_features, self.bias)
        if self.packed is not None and self.plan.serves(x.shape[0]):
            return cpu_gemm.packed_product(
                x, self.plan.packed_format, self.packed, self.weight, self.bias
            )
        return cpu_gemm.plain_product(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The merged output as one view per original layer."""
        return self(x).split(self.sizes, dim=-1)
