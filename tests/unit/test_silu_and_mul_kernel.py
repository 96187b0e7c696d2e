"""SwiGLU's fused activation (`kernels/cpu/silu_and_mul.cpp`, through
`models/activation.silu_and_mul`) against `F.silu(gate) * up`, the torch ops it replaces.

Its e^x is a polynomial, not SLEEF's, so it is compared within float rounding (a few ulp).
Sizes cover a decode batch (no parallel region), a prompt (rows over the intra-op
threads), widths that are not a multiple of the kernel's 8 lanes, inputs far into both
tails of the sigmoid, and more than two dimensions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from services.worker.models import activation


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build (see cpu_kernels_unavailable)")


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize(("rows", "width"), [(1, 16), (16, 5504), (3, 2 * 13), (400, 2 * 344)])
def test_matches_torch_within_rounding(rows, width):
    gate_up = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)) * 6
    got = torch.ops.tandem_cpu.silu_and_mul(gate_up)
    assert got.shape == (rows, width // 2)
    torch.testing.assert_close(got, reference(gate_up), rtol=4e-7, atol=1e-30)


def test_tails_of_the_sigmoid():
    gate = torch.tensor([-200.0, -90.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 90.0, 200.0])
    gate_up = torch.cat([gate.repeat(2), torch.full((22,), 1.5)]).view(1, 44)
    got = torch.ops.tandem_cpu.silu_and_mul(gate_up)
    torch.testing.assert_close(got, reference(gate_up), rtol=4e-7, atol=1e-30)
    assert torch.isfinite(got).all()


def test_prompt_rows_in_parallel_equal_rows_alone():
    """A row's result does not depend on which thread or which call computes it."""
    gate_up = torch.randn(300, 2 * 2752, generator=torch.Generator().manual_seed(1))
    together = torch.ops.tandem_cpu.silu_and_mul(gate_up)
    alone = torch.cat(
        [torch.ops.tandem_cpu.silu_and_mul(gate_up[i : i + 1]) for i in (0, 150, 299)]
    )
    assert torch.equal(together[[0, 150, 299]], alone)


def test_leading_dimensions_are_kept():
    gate_up = torch.randn(2, 3, 20)
    got = activation.silu_and_mul(gate_up)
    assert got.shape == (2, 3, 10)
    torch.testing.assert_close(got, reference(gate_up), rtol=4e-7, atol=1e-30)


def test_what_the_kernel_does_not_take_uses_torch():
    strided = torch.randn(16, 40)[:, :32]  # not contiguous
    assert torch.equal(activation.silu_and_mul(strided), reference(strided))
    half = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(activation.silu_and_mul(half), reference(half))


def test_rejects_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="last dimension must be even"):
        torch.ops.tandem_cpu.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.tandem_cpu.silu_and_mul(torch.randn(4, 8, dtype=torch.float64))
