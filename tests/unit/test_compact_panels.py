"""`compact_panels`: finding the GGUF Q4_1 / Q8_0 blocks and the bfloat16 values a float32
weight exactly holds (the values GGUF's own quantizer and dequantizer give), refusing a
weight any value of which they would change, and the panels the packed kernel multiplies
bit for bit like the float32 panels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels import cpu_ops
from services.worker.models import compact_panels


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build (see cpu_kernels_unavailable)")


def _gguf_values(out_features: int, depth: int, qtype, seed: int = 0) -> torch.Tensor:
    """A transposed `[depth, out]` weight of exactly what GGUF's `qtype` round trip gives."""
    rows = np.random.default_rng(seed).standard_normal((out_features, depth)).astype(np.float32)
    rows[0, :32] = 0.25  # one block of equal values (scale 0)
    exact = quants.dequantize(quants.quantize(rows * 0.05, qtype), qtype)
    return torch.from_numpy(np.ascontiguousarray(exact.T))


@pytest.mark.parametrize(
    "qtype,width", [(GGMLQuantizationType.Q4_1, 320), (GGMLQuantizationType.Q8_0, 544)]
)
@pytest.mark.parametrize("out_features,depth", [(40, 96), (64, 576), (7, 32)])
def test_gguf_blocks_are_found_and_multiply_like_float_panels(qtype, width, out_features, depth):
    weight_t = _gguf_values(out_features, depth, qtype)
    blocks = compact_panels.block_panels(weight_t)
    assert blocks is not None and blocks.dtype == torch.uint8
    assert blocks.shape == (-(-out_features // 16), depth // 32, width)
    float_panels = torch.ops.tandem_cpu.pack_linear_weight(weight_t)
    bias = torch.randn(out_features)
    x = torch.randn(140, depth)
    for rows in (0, 1, 2, 5, 12, 13, 16, 31, 64, 65, 140):  # decode blocks and prompt order
        got = torch.ops.tandem_cpu.packed_linear(x[:rows], blocks, out_features, bias)
        want = torch.ops.tandem_cpu.packed_linear(x[:rows], float_panels, out_features, bias)
        assert torch.equal(got, want), rows


def test_q4_1_values_take_q4_1_not_q8_0():
    weight_t = _gguf_values(32, 64, GGMLQuantizationType.Q4_1)
    assert compact_panels.block_panels(weight_t).shape[-1] == compact_panels.Q4_BYTES


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_one_value_off_the_blocks_refuses_them(qtype):
    weight_t = _gguf_values(32, 64, qtype)
    weight_t[5, 3] = torch.nextafter(weight_t[5, 3], torch.tensor(1.0))
    assert compact_panels.block_panels(weight_t) is None


def test_random_float32_and_depths_off_the_block_have_no_blocks():
    assert compact_panels.block_panels(torch.randn(64, 16)) is None
    exact = _gguf_values(16, 64, GGMLQuantizationType.Q8_0)
    assert compact_panels.block_panels(exact[:48]) is None  # 48 is not a multiple of 32


def test_bfloat16_values_narrow_and_others_stay():
    weight = torch.randn(32, 48).to(torch.bfloat16).float()
    assert compact_panels.narrowest_float(weight).dtype == torch.bfloat16
    weight[3, 7] += 1e-6
    assert compact_panels.narrowest_float(weight) is weight
