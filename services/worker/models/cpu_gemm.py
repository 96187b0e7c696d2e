"""Which CPU matrix product multiplies float32 activations by a linear layer's weight, per
batch size: plain `torch.mm` on the transposed weight, or a packed copy of the weight in
MKL's, oneDNN's or Tandem's own (`kernels/cpu/packed_linear.cpp`) blocked layout.

The fastest differs by CPU and by row count: on an AVX-512 Xeon MKL's packed GEMM beat the
others at 2-32 rows; on an AVX2 EPYC oneDNN's packed GEMM runs a decode step's projections
in half MKL's time at 2-64 rows, and Tandem's panels in ~0.7x oneDNN's at 8-32 rows. So
`auto` measures the model's own weights at load (`measure`), and `gemm_plan.choose_plan`
keeps one packed format and the row counts where it beats the plain product. `mkl`,
`onednn` and `tandem` name a format without measuring. oneDNN's and Tandem's packed copies
take the weight's bytes (Tandem's pads the output columns to a multiple of 16); MKL's about
2.2-2.6x. Tandem's panels hold bfloat16 where every value of the weight is one, and a weight
made of GGUF Q4_1/Q8_0 blocks also keeps those blocks for the smallest products
(`compact_panels.py`): the same products from fewer bytes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from kernels import cpu_ops
from services.worker.models import compact_panels
from services.worker.models.gemm_plan import (
    CHOICES,
    MEASURE_BYTES,
    MEASURED_ROWS,
    PLAIN,
    STATIC_ROWS,
    GemmPlan,
    choose_plan,
    static_plan,
)


def available_formats() -> tuple[str, ...]:
    found = []
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        found.append("mkl")
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        found.append("onednn")
    if cpu_ops.available():
        found.append("tandem")
    return tuple(found)


def pack(weight_t: torch.Tensor, fmt: str) -> torch.Tensor:
    """A packed copy of a transposed (`[in, out]`) float32 weight."""
    if fmt == "tandem":  # panels of 16 output columns (bfloat16 where that is exact)
        return torch.ops.tandem_cpu.pack_linear_weight(compact_panels.narrowest_float(weight_t))
    weight = weight_t.t().contiguous()
    if fmt == "mkl":  # the packed layout does not depend on the row count it is made for
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, max(STATIC_ROWS["mkl"]))
    if fmt == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    raise ValueError(f"unknown packed format {fmt!r}")


def packed_bytes(packed: torch.Tensor, weight_t: torch.Tensor, fmt: str) -> int:
    if fmt == "onednn":  # an opaque oneDNN tensor holding the weight's elements
        return weight_t.numel() * weight_t.element_size()
    return packed.numel() * packed.element_size()


def block_panels(weight_t: torch.Tensor, fmt: str) -> torch.Tensor | None:
    """Tandem's block-quantized panels of the weight when its values are exactly GGUF Q4_1 or
    Q8_0 blocks (the products of up to `compact_panels.BLOCK_PANEL_ROWS` rows take them)."""
    return compact_panels.block_panels(weight_t) if fmt == "tandem" else None


def packed_product(
    x: torch.Tensor,
    fmt: str,
    packed: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if fmt == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if fmt == "tandem":
        return torch.ops.tandem_cpu.packed_linear(x, packed, weight_t.shape[1], bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight_t.t(), bias, x.shape[0])


def plain_product(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None):
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def measure(
    weights_t: Sequence[torch.Tensor],
    formats: Sequence[str],
    rows: Sequence[int] = MEASURED_ROWS,
    repeats: int = 5,
    budget_bytes: int = MEASURE_BYTES,
) -> dict[str, dict[int, float]]:
    """Microseconds for one pass over the first weights (up to `budget_bytes`) at each row
    count: plain and each packed format; the best of `repeats` after a warm-up pass.

    The repeats go round-robin over every (row count, format) cell rather than one cell at
    a time: a worker measures while its neighbours start (another worker loading its
    weights takes a core for a second or more), and a burst of that must not land on every
    repeat of one cell (it once made oneDNN look 2x slower than plain at one row)."""
    chosen, total = [], 0
    for weight in weights_t:
        if chosen and total >= budget_bytes:
            break
        chosen.append(weight)
        total += weight.numel() * weight.element_size()
    copies = {"plain": [None] * len(chosen)}
    copies.update({fmt: [pack(w, fmt) for w in chosen] for fmt in formats})
    inputs = {count: {w.shape[0]: torch.randn(count, w.shape[0]) for w in chosen} for count in rows}

    def run(name: str, count: int) -> float:
        start = time.perf_counter()
        for weight, packed in zip(chosen, copies[name], strict=True):
            x = inputs[count][weight.shape[0]]
            if packed is None:
                plain_product(x, weight, None)
            else:
                packed_product(x, name, packed, weight, None)
        return time.perf_counter() - start

    best = {name: dict.fromkeys(rows, math.inf) for name in copies}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # round 0 warms up (oneDNN builds its kernels)
            for count in rows:
                for name in copies:
                    seconds = run(name, count)
                    if round_:
                        best[name][count] = min(best[name][count], seconds)
    return {
        name: {count: round(s * 1e6, 1) for count, s in cells.items()}
        for name, cells in best.items()
    }


def plan_for(setting: str, weights_t: Sequence[torch.Tensor]) -> GemmPlan:
    """The plan for `cpu_gemm` = `setting` over these transposed float32 weights."""
    if setting not in CHOICES:
        raise ValueError(f"cpu_gemm must be one of {', '.join(CHOICES)}, got {setting!r}")
    formats = available_formats()
    if setting != "auto":
        return static_plan(setting) if setting in formats else PLAIN
    if not formats or not weights_t:
        return PLAIN
    return choose_plan(measure(weights_t, formats))
