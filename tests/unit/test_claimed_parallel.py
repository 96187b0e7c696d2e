"""Work claimed by threads as they go (`kernels/cpu/claimed_parallel.h`), as the packed decode
GEMM and the decode attention kernel use it: every thread count, including more threads than
the box has cores (the extra threads are preempted, so the others take over their shares),
gives bit-for-bit the output of one thread. An item left out would leave `torch.empty`'s
garbage (or NaN, below) in its outputs; an item split differently would round differently.
Shapes are chosen so that the work does not divide evenly into grains or shares.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu_ops


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    if not cpu_ops.available():
        pytest.fail("the C++ CPU kernels did not build (see cpu_kernels_unavailable)")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _per_thread_count(run) -> None:
    torch.set_num_threads(1)
    want = run()
    assert not want.isnan().any()
    for threads in (2, 3, 5, 8):
        torch.set_num_threads(threads)
        for _ in range(3):  # the claims race differently each time
            assert torch.equal(run(), want), f"{threads} threads"


# depth 512: 2 panels per claim; 1536: 1 per claim; 96: all of a small product in one claim
@pytest.mark.parametrize("depth,width", [(512, 16 * 37 + 5), (1536, 16 * 9), (96, 40)])
@pytest.mark.parametrize("rows", [1, 16, 33])
def test_packed_linear_equals_one_thread_at_every_thread_count(depth, width, rows, restore_threads):
    gen = torch.Generator().manual_seed(depth + width + rows)
    weight_t = torch.randn(depth, width, generator=gen)
    bias = torch.randn(width, generator=gen)
    packed = torch.ops.tandem_cpu.pack_linear_weight(weight_t)
    x = torch.randn(rows, depth, generator=gen)
    _per_thread_count(lambda: torch.ops.tandem_cpu.packed_linear(x, packed, width, bias))


@pytest.mark.parametrize("num_seqs", [1, 3, 19], ids=["split-by-kv-head", "few", "many"])
def test_decode_attention_equals_one_thread_at_every_thread_count(num_seqs, restore_threads):
    gen = torch.Generator().manual_seed(num_seqs)
    heads, kv_heads, head_dim, block_size = 8, 4, 32, 16
    lens = torch.randint(1, 150, (num_seqs,), generator=gen)
    per_seq = -(-int(lens.max()) // block_size)
    num_blocks = num_seqs * per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, per_seq)
    query = torch.randn(num_seqs, heads, head_dim, generator=gen)

    def run():
        out = torch.full_like(query, float("nan"))
        torch.ops.tandem_cpu.paged_decode_attention(
            out, query, k_cache, v_cache, tables, lens, 1 / math.sqrt(head_dim)
        )
        return out

    _per_thread_count(run)
