"""Tandem's packed decode GEMM (`kernels/cpu/packed_linear.cpp`) against `torch.addmm` in
float64: every row count a plan can hand it (the even split into blocks of at most 6 rows,
16 with AVX-512, makes each count a different set of micro-kernels), output widths that are
and are not a multiple of the 16-column panels, depths that are and are not a multiple of
the 128-deep chunks and of the four values of k the decode loop takes at a time (134: a last
chunk of 6, four unrolled and two alone), bias and none, strided inputs; and the errors it
gives for inputs it cannot take. bfloat16 panels (a weight whose every value is a bfloat16)
give exactly the float32 panels' products, on every loop order.

The kernel sums each output over k in order with FMAs, so it is compared within float32
rounding of a K-term dot product, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build (see cpu_kernels_unavailable)")


def _reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None):
    wide = x.double() @ weight_t.double()
    return (wide if bias is None else wide + bias.double()).float()


def _close(got: torch.Tensor, want: torch.Tensor, depth: int) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6 * depth, rtol=1e-5)


@pytest.mark.parametrize(
    "depth,width", [(48, 64), (300, 37), (256, 16), (129, 200), (134, 24), (512, 8)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_row_count_up_to_a_plan_limit(depth, width, with_bias):
    gen = torch.Generator().manual_seed(depth * width)
    weight_t = torch.randn(depth, width, generator=gen)
    bias = torch.randn(width, generator=gen) if with_bias else None
    packed = torch.ops.tandem_cpu.pack_linear_weight(weight_t)
    assert packed.shape == (-(-width // 16), depth, 16)
    x = torch.randn(70, depth, generator=gen)
    for rows in range(71):
        got = torch.ops.tandem_cpu.packed_linear(x[:rows], packed, width, bias)
        _close(got, _reference(x[:rows], weight_t, bias), depth)


@pytest.mark.parametrize("depth,width", [(300, 37), (134, 24), (576, 160)])
def test_bfloat16_panels_give_the_float32_panels_products_bit_for_bit(depth, width):
    gen = torch.Generator().manual_seed(depth + width)
    narrow = torch.randn(depth, width, generator=gen).to(torch.bfloat16)
    bias = torch.randn(width, generator=gen)
    wide_panels = torch.ops.tandem_cpu.pack_linear_weight(narrow.float())
    narrow_panels = torch.ops.tandem_cpu.pack_linear_weight(narrow)
    assert narrow_panels.dtype == torch.bfloat16
    assert torch.equal(narrow_panels.float(), wide_panels)
    x = torch.randn(130, depth, generator=gen)
    for rows in (*range(0, 26), 31, 32, 33, 64, 65, 130):  # decode blocks and prompt order
        for b in (None, bias):
            got = torch.ops.tandem_cpu.packed_linear(x[:rows], narrow_panels, width, b)
            want = torch.ops.tandem_cpu.packed_linear(x[:rows], wide_panels, width, b)
            assert torch.equal(got, want), rows


def test_packing_pads_the_last_panel_with_zeros_and_keeps_the_columns():
    weight_t = torch.arange(3 * 20, dtype=torch.float32).view(3, 20)
    packed = torch.ops.tandem_cpu.pack_linear_weight(weight_t)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0], weight_t[:, :16])
    assert torch.equal(packed[1, :, :4], weight_t[:, 16:])
    assert not packed[1, :, 4:].any()


def test_strided_inputs_are_read_as_their_values():
    gen = torch.Generator().manual_seed(1)
    weight_t = torch.randn(64, 32, generator=gen)
    packed = torch.ops.tandem_cpu.pack_linear_weight(weight_t.t().contiguous().t())
    wide = torch.randn(9, 128, generator=gen)
    x = wide[:, ::2]  # every other feature: not contiguous
    got = torch.ops.tandem_cpu.packed_linear(x, packed, 32, None)
    _close(got, _reference(x, weight_t, None), 64)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda p: torch.ops.tandem_cpu.packed_linear(torch.randn(2, 8), p, 20, None), "features"),
        (lambda p: torch.ops.tandem_cpu.packed_linear(torch.randn(2, 16), p, 33, None), "panels"),
        (lambda p: torch.ops.tandem_cpu.packed_linear(torch.randn(2, 16), p, 16, None), "panels"),
        (
            lambda p: torch.ops.tandem_cpu.packed_linear(torch.randn(2, 16).double(), p, 20, None),
            "float32",
        ),
        (
            lambda p: torch.ops.tandem_cpu.packed_linear(torch.randn(2, 16), p, 20, torch.ones(3)),
            "bias",
        ),
        (
            lambda p: torch.ops.tandem_cpu.packed_linear(torch.randn(2, 16), p[:, :, :8], 20, None),
            "packed",
        ),
    ],
)
def test_inputs_it_cannot_take_raise(call, message):
    packed = torch.ops.tandem_cpu.pack_linear_weight(torch.randn(16, 20))
    with pytest.raises(RuntimeError, match=message):
        call(packed)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tandem_cpu.pack_linear_weight(torch.randn(16, 20).half())
