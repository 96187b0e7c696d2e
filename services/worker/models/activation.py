"""SwiGLU's activation, `silu(gate) * up`, over the merged gate/up projection's output.

On CPU in float32, with the C++ kernels built, one call (`kernels/cpu/silu_and_mul.cpp`,
vLLM's `silu_and_mul`): no intermediate tensor, no parallel region for a decode batch.
Anything else (GPU, half precision, no compiler) takes `F.silu(gate).mul_(up)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` [..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    if (
        gate_up.dtype == torch.float32
        and gate_up.device.type == "cpu"
        and gate_up.is_contiguous()
        and cpu_ops.available()
    ):
        return torch.ops.tandem_cpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
