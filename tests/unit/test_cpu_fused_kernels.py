"""The fused C++ CPU kernels of a decoder layer against the torch ops they replace:
RMSNorm alone and after the residual add (`kernels/cpu/rms_norm.cpp`, through
`models/rms_norm.RMSNorm`), and the rotary embedding with the K/V cache write
(`kernels/cpu/rotary_write.cpp`, through `cpu_paged_attention.rotate_and_write`).

The norm's sum of squares is ordered differently from torch's, so it is compared to
Hugging Face's formula within float rounding; the residual sum and the rotation are the
same float operations as torch's, so those must be bit-identical. Sizes cover a decode
batch (no parallel region), a prompt (rows over the intra-op threads), row lengths that
are not a multiple of the kernel's lanes, strided cache views and skipped slots.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops, cpu_paged_attention
from services.worker.kv_cache import KvCache
from services.worker.models import rms_norm
from services.worker.models.rms_norm import RMSNorm
from services.worker.models.rope import RotaryEmbedding, rotate


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build (see cpu_kernels_unavailable)")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, float32."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _norm(size: int, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(size, 1e-6, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(seed)))
    return norm


SHAPES = [(1, 512), (16, 1024), (3, 100), (3000, 64)]


@pytest.mark.parametrize("rows, size", SHAPES, ids=["one", "batch", "odd-size", "prompt"])
def test_rms_norm_matches_hugging_face(rows, size):
    x = torch.randn(rows, size) * 3
    norm = _norm(size)
    out = torch.ops.tandem_cpu.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(out, hf_rms_norm(x, norm.weight, norm.eps), rtol=2e-6, atol=2e-6)
    assert torch.equal(norm(x), out)  # the module takes the kernel for this input


@pytest.mark.parametrize("rows, size", SHAPES, ids=["one", "batch", "odd-size", "prompt"])
def test_add_rms_norm_sums_exactly_then_normalises(rows, size):
    residual, x = torch.randn(rows, size), torch.randn(rows, size)
    norm = _norm(size)
    total, normed = norm.add_forward(residual, x)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, torch.ops.tandem_cpu.rms_norm(total, norm.weight, norm.eps))
    torch.testing.assert_close(normed, hf_rms_norm(residual + x, norm.weight, norm.eps))


def test_inputs_the_kernel_does_not_take_use_torch():
    norm = _norm(64)
    heads = torch.randn(5, 6, 64)[:, 1:4]  # a strided view, as qwen3's per-head q/k norm
    assert not heads.is_contiguous()
    assert torch.equal(norm(heads), F.rms_norm(heads, (64,), norm.weight, norm.eps))
    half = _norm(64).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = half.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, True) + 1e-6)).to(
        torch.bfloat16
    )
    assert torch.equal(half(x), expected)
    total, normed = half.add_forward(x, x)
    assert torch.equal(total, x + x) and torch.equal(normed, half(x + x))


def test_without_the_kernels_the_module_is_torchs(monkeypatch):
    monkeypatch.setattr(rms_norm.cpu_ops, "available", lambda: False)
    norm, x, residual = _norm(128), torch.randn(7, 128), torch.randn(7, 128)
    assert torch.equal(norm(x), F.rms_norm(x, (128,), norm.weight, norm.eps))
    total, normed = norm.add_forward(residual, x)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, F.rms_norm(residual + x, (128,), norm.weight, norm.eps))


def test_rms_norm_rejects_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.tandem_cpu.rms_norm(torch.randn(2, 8).double(), torch.ones(8).double(), 1e-6)
    with pytest.raises(RuntimeError, match="last dimension"):
        torch.ops.tandem_cpu.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.tandem_cpu.add_rms_norm(torch.randn(3, 8), torch.randn(2, 8), torch.ones(8), 1e-6)


HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 32, 4


def _rotary_case(num_tokens: int, skipped: bool):
    """A step's merged projection output, its rope tables and a plan over the strided
    per-layer views of a real KvCache (blocks in shuffled order)."""
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen) * 2
    positions = torch.randint(0, 1000, (num_tokens,), generator=gen)
    tables = RotaryEmbedding(HEAD_DIM, 1024, 10000.0).tables(positions, torch.float32)
    num_blocks = -(-num_tokens // BLOCK) + 3
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:num_tokens]
    if skipped:
        slots[::3] = -1
    plan = cpu_paged_attention.plan(
        slots, torch.zeros(1, 1, dtype=torch.int64), [0, num_tokens], [num_tokens], BLOCK
    )
    caches = [KvCache(num_blocks, BLOCK, 2, KV_HEADS, HEAD_DIM, torch.float32) for _ in range(2)]
    for cache in caches:
        cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(1)))
    return qkv, tables, plan, caches


@pytest.mark.parametrize(
    "num_tokens, skipped",
    [(1, False), (16, False), (20, True), (700, False)],
    ids=["one", "decode-batch", "skipped-slots", "prompt"],
)
def test_rotate_and_write_is_bit_identical_to_rotate_then_write(num_tokens, skipped):
    qkv, tables, plan, (fused_cache, torch_cache) = _rotary_case(num_tokens, skipped)
    k_cache, v_cache = fused_cache.layer(1)
    assert not k_cache.is_contiguous()  # the cache's per-layer views are strided
    q, k, v = cpu_paged_attention.rotate_and_write(
        qkv, HEADS, KV_HEADS, tables, k_cache, v_cache, plan
    )
    rotated = rotate(qkv[:, : HEADS + KV_HEADS], tables)
    expected_q, expected_k = rotated[:, :HEADS], rotated[:, HEADS:]
    expected_v = qkv[:, HEADS + KV_HEADS :]
    cpu_paged_attention.write(expected_k, expected_v, *torch_cache.layer(1), plan)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k) and torch.equal(v, expected_v)
    assert torch.equal(fused_cache.data, torch_cache.data)  # same slots, other layers untouched


def test_rotate_and_write_declines_what_it_does_not_take():
    qkv, tables, plan, (cache, _) = _rotary_case(4, False)
    k_cache, v_cache = cache.layer(0)
    call = cpu_paged_attention.rotate_and_write
    assert call(qkv, HEADS, KV_HEADS, tables, k_cache.bfloat16(), v_cache, plan) is None
    assert call(qkv.transpose(0, 1), HEADS, KV_HEADS, tables, k_cache, v_cache, plan) is None
    no_kernel = cpu_paged_attention.plan(
        torch.arange(4), torch.zeros(1, 1, dtype=torch.int64), [0, 4], [4], BLOCK, use_kernel=False
    )
    assert call(qkv, HEADS, KV_HEADS, tables, k_cache, v_cache, no_kernel) is None


def test_rotary_write_rejects_out_of_range_slots():
    qkv, tables, plan, (cache, _) = _rotary_case(4, False)
    k_cache, v_cache = cache.layer(0)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tandem_cpu.rotary_write(
            qkv, *tables, HEADS, KV_HEADS, k_cache, v_cache,
            plan.write_blocks + 1000, plan.write_offsets, None,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="num_heads"):
        torch.ops.tandem_cpu.rotary_write(
            qkv, *tables, HEADS, KV_HEADS + 1, k_cache, v_cache,
            plan.write_blocks, plan.write_offsets, None,
        )  # fmt: skip
