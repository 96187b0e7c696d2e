"""The Triton paged kernels (cache write, split-KV decode, varlen prefill) against the
plain-torch reference in `kernels.torch_paged`, element by element.

Without CUDA the kernels run under the Triton CPU interpreter (selected below, before the
kernel modules are imported) on tiny shapes; with CUDA the same tests run compiled on the
GPU, plus the CUDA-graph capture test. Caches are strided per-layer views of a real
`KvCache`, NaN everywhere nothing was written (unused blocks, the tail of each last block,
the other layer), and block tables are shuffled and padded with block 0 (also NaN), so any
read outside a sequence's context poisons the result.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel definitions

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402

from kernels import torch_paged  # noqa: E402
from kernels.paged_decode_attention import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
)
from kernels.paged_prefill_attention import paged_prefill_attention  # noqa: E402
from kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from services.worker.kv_cache import KvCache  # noqa: E402
from tests.gpu.graph_safety import no_host_reads  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without a GPU")
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")),
]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.6e-2),
}
LAYER = 1  # of 2: the views' strides skip the other layer and the K/V pair


def strided(shape: tuple[int, ...], dtype, device, gen: torch.Generator) -> torch.Tensor:
    """Random `[T, heads, head_dim]` as a view into a wider NaN buffer (like q/k/v split out
    of a fused projection): row stride > heads * head_dim, NaN between the rows."""
    rows, heads, dim = shape
    buffer = torch.full((rows, (heads + 1) * dim), float("nan"), dtype=dtype, device=device)
    view = buffer[:, dim:].view(rows, heads, dim)
    view.copy_(torch.randn(shape, generator=gen).to(dtype))
    return view


def paged_context(
    seq_lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    cache_dtype: torch.dtype | None = None,
) -> tuple[KvCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cache, k_cache, v_cache, block_tables): each sequence's random K/V (in `dtype`, cast
    to `cache_dtype` when given) written through a shuffled block table into layer LAYER of a
    NaN-filled cache; tables padded with block 0 (never allocated, NaN) plus one extra
    column."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    cache = KvCache(num_blocks, block_size, 2, kv_heads, head_dim, cache_dtype or dtype, device)
    cache.data.fill_(float("nan"))
    k_cache, v_cache = cache.layer(LAYER)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    for i, seq_len in enumerate(seq_lens):
        table = torch.tensor([order.pop() for _ in range(needed[i])])
        tables[i, : needed[i]] = table.to(torch.int32)
        pos = torch.arange(seq_len)
        slots = (table[pos // block_size] * block_size + pos % block_size).to(device)
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        torch_paged.reshape_and_cache(k, v, k_cache, v_cache, slots)
    return cache, k_cache, v_cache, tables.to(device)


def reference(query, k_cache, v_cache, tables, query_start_loc, seq_lens, scale):
    """The torch reference in fp32 on the same (upcast) inputs."""
    return torch_paged.paged_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, query_start_loc, seq_lens, scale
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected, **TOLERANCE[dtype])


# -- reshape_and_cache ----------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "src_dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),  # cast on the way in
        # The interpreter truncates fp32 -> bf16 instead of rounding to nearest: GPU only.
        pytest.param(torch.float32, torch.bfloat16, marks=needs_cuda),
    ],
)
def test_reshape_and_cache_matches_reference(device, src_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    block_size, kv_heads, head_dim = 4, 2, 16
    caches = []
    for _ in range(2):
        cache = KvCache(6, block_size, 2, kv_heads, head_dim, cache_dtype, device)
        cache.data.copy_((torch.randn(cache.data.shape, generator=gen) * 1000).to(cache_dtype))
        caches.append(cache)
    caches[1].data.copy_(caches[0].data)
    # 9 tokens: scattered distinct slots, three skipped (-1), one in the last slot.
    slots = torch.tensor([5, -1, 23, 0, 17, -1, 9, 12, -1], dtype=torch.int64, device=device)
    key = strided((9, kv_heads, head_dim), src_dtype, device, gen)
    value = strided((9, kv_heads, head_dim), src_dtype, device, gen)
    reshape_and_cache(key, value, *caches[0].layer(LAYER), slots)
    torch_paged.reshape_and_cache(key, value, *caches[1].layer(LAYER), slots)
    # Written rows equal the reference's; everything else (other layer, -1 rows) untouched.
    assert torch.equal(caches[0].data, caches[1].data)
    k_cache, v_cache = caches[0].layer(LAYER)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(k_cache[block, offset], key[token].to(cache_dtype))
            assert torch.equal(v_cache[block, offset], value[token].to(cache_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_all_skipped_and_empty(device):
    cache = KvCache(2, 4, 1, 1, 16, torch.float32, device)
    cache.data.fill_(7.0)
    key = torch.randn(3, 1, 16, device=device)
    reshape_and_cache(key, key, *cache.layer(0), torch.full((3,), -1, device=device))
    empty = key[:0]
    reshape_and_cache(
        empty, empty, *cache.layer(0), torch.zeros(0, dtype=torch.long, device=device)
    )
    assert torch.equal(cache.data, torch.full_like(cache.data, 7.0))
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(
            key, key, *cache.layer(0), torch.zeros(2, dtype=torch.long, device=device)
        )


# -- prefill / extend -----------------------------------------------------------------------
# (prefix already cached, new tokens) per sequence: a chunk spanning two query tiles on a
# long prefix, a fresh prompt, a decode row, a one-token prompt, a short chunk.
MIXED_BATCH = [(40, 20), (0, 9), (30, 1), (0, 1), (5, 3)]


def run_prefill(batch, q_heads, kv_heads, head_dim, block_size, dtype, device, cache_dtype=None):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [prefix + new for prefix, new in batch]
    starts = [0]
    for _, new in batch:
        starts.append(starts[-1] + new)
    _, k_cache, v_cache, tables = paged_context(
        seq_lens, block_size, kv_heads, head_dim, dtype, device, gen, cache_dtype
    )
    query = strided((starts[-1], q_heads, head_dim), dtype, device, gen)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        tables,
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale,
        max_query_len=max(new for _, new in batch),
    )
    return out, reference(query, k_cache, v_cache, tables, starts, seq_lens, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (32, 8)])
def test_prefill_mixed_batch_matches_reference(device, dtype, head_dim, block_size):
    out, expected = run_prefill(MIXED_BATCH, 8, 2, head_dim, block_size, dtype, device)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,block_size",
    [
        (4, 4, 64, 16),  # MHA
        (8, 1, 128, 32),  # MQA (group of 8); fp32 key tiles of 16 inside blocks of 32
        (6, 2, 24, 8),  # group of 3 and head_dim 24: both padded and masked
        (2, 2, 16, 16),  # group of 1: a tile row per token
    ],
)
def test_prefill_shapes(device, q_heads, kv_heads, head_dim, block_size):
    batch = [(13, 7), (0, 18), (9, 0), (21, 1)]  # (9, 0): a sequence with no new tokens
    out, expected = run_prefill(
        batch, q_heads, kv_heads, head_dim, block_size, torch.float32, device
    )
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_rejects_bad_arguments(device):
    k_cache = torch.zeros(4, 4, 2, 16, device=device)
    query = torch.zeros(3, 8, 16, device=device)
    tables = torch.zeros(1, 4, dtype=torch.int32, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    starts = torch.tensor([0, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_prefill_attention(query[:, :3], k_cache, k_cache, tables, starts, lens, 1.0, 3)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(query, k_cache, k_cache, tables, starts[:1], lens, 1.0, 3)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention(query[..., :8], k_cache, k_cache, tables, starts, lens, 1.0, 3)


# -- decode ---------------------------------------------------------------------------------
DECODE_LENS = [1, 5, 33, 64, 17]  # 1..4 key tiles of 16 at head_dim 16


def run_decode(seq_lens, q_heads, kv_heads, head_dim, block_size, dtype, device, **kwargs):
    gen = torch.Generator().manual_seed(2)
    cache_dtype = kwargs.pop("cache_dtype", None)
    _, k_cache, v_cache, tables = paged_context(
        seq_lens, block_size, kv_heads, head_dim, dtype, device, gen, cache_dtype
    )
    query = strided((len(seq_lens), q_heads, head_dim), dtype, device, gen)
    scale = head_dim**-0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, **kwargs)
    starts = list(range(len(seq_lens) + 1))
    return out, reference(query, k_cache, v_cache, tables, starts, seq_lens, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, 8, None])
def test_decode_matches_reference(device, dtype, num_splits):
    # 3 splits: uneven ranges, the 1- and 5-token sequences leave two empty; 8 splits: at
    # most 4 tiles per sequence, so at least half the splits of every sequence are empty.
    out, expected = run_decode(
        DECODE_LENS, 8, 2, 16, 4, dtype, device, num_splits=num_splits, max_seq_len=64
    )
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,block_size,num_splits",
    [
        (4, 4, 32, 8, 2),  # MHA
        (8, 1, 64, 16, 1),  # MQA
        (6, 2, 24, 4, 2),  # group of 3, head_dim 24
        (16, 2, 128, 32, 2),  # group of 8, large head
    ],
)
def test_decode_shapes(device, q_heads, kv_heads, head_dim, block_size, num_splits):
    kwargs = dict(num_splits=num_splits, max_seq_len=64)
    out, expected = run_decode(
        [3, 64, 40], q_heads, kv_heads, head_dim, block_size, torch.float32, device, **kwargs
    )
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_defaults_need_no_bounds(device):
    """Neither num_splits nor max_seq_len: the bound comes from the block table's width."""
    out, expected = run_decode(DECODE_LENS, 4, 2, 16, 8, torch.float32, device)
    assert_matches(out, expected, torch.float32)


# -- fp8 (e4m3fn) cache -----------------------------------------------------------------------
FP8 = torch.float8_e4m3fn


def e4m3_edge_values() -> torch.Tensor:
    """fp32 values at every rounding decision of float8_e4m3fn, both signs: each finite e4m3
    value, each midpoint between neighbours (ties: to even) and one fp32 ulp either side of
    it, subnormals, past +-448 (saturates), +-inf and NaN."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = finite[finite.isfinite() & (finite >= 0)].unique()  # 0 .. 448
    mid = (finite[1:] + finite[:-1]) / 2
    up, down = torch.full_like(mid, float("inf")), torch.zeros_like(mid)
    extra = [464.0, 470.0, 479.0, 480.0, 1e4, float("inf"), float("nan"), 2.0**-10, 1e-30]
    values = torch.cat([finite, mid, mid.nextafter(up), mid.nextafter(down), torch.tensor(extra)])
    return torch.cat([values, -values])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_fp8_rounds_like_torch(device, src_dtype):
    """Written bytes equal the reference's (torch's `.to(float8_e4m3fn)`), bit for bit, at
    every rounding edge; other slots and layers keep their bytes."""
    gen = torch.Generator().manual_seed(5)
    block_size, kv_heads, head_dim, tokens = 4, 4, 64, 9
    edges = e4m3_edge_values().to(src_dtype)
    need = tokens * kv_heads * head_dim
    assert edges.numel() <= 2 * need
    rows = torch.cat([edges, torch.randn(2 * need - edges.numel(), generator=gen).to(src_dtype)])
    key = rows[:need].view(tokens, kv_heads, head_dim).to(device)
    value = rows[need:].view(tokens, kv_heads, head_dim).to(device)
    caches = [KvCache(4, block_size, 2, kv_heads, head_dim, FP8, device) for _ in range(2)]
    noise = torch.randint(0, 256, caches[0].bytes.shape, generator=gen, dtype=torch.uint8)
    for cache in caches:
        cache.bytes.copy_(noise)
    slots = torch.tensor([5, -1, 15, 0, 11, 2, 9, 12, 7], dtype=torch.int64, device=device)
    reshape_and_cache(key, value, *caches[0].layer(LAYER), slots)
    torch_paged.reshape_and_cache(key, value, *caches[1].layer(LAYER), slots)
    ours, torch_bytes = caches[0].bytes.cpu(), caches[1].bytes.cpu()
    if not torch.equal(ours, torch_bytes):  # name the inputs that round differently
        written = (slots >= 0).cpu()
        rows = slots[slots >= 0]
        got, want = (
            torch.cat([c.reshape(-1, kv_heads, head_dim)[rows] for c in cache.layer(LAYER)])
            .view(torch.uint8)
            .cpu()
            for cache in caches
        )
        inputs = torch.cat([key.cpu()[written], value.cpu()[written]]).float()
        cpu_ref = inputs.to(FP8).view(torch.uint8)
        bad = (got != want).nonzero()[:12].tolist()
        pytest.fail(
            f"{(ours != torch_bytes).sum().item()} bytes differ: "
            + "; ".join(
                f"x={inputs[tuple(i)].item()!r} kernel={got[tuple(i)].item()} "
                f"torch={want[tuple(i)].item()} cpu={cpu_ref[tuple(i)].item()}"
                for i in bad
            )
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,num_splits", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 3)]
)
def test_decode_fp8_cache_matches_reference(device, dtype, num_splits):
    """Keys and values read from an fp8 cache, against the reference's own upcast of the
    same cache (bf16 queries: on a GPU the tensor-core path, fp8 tiles upcast to bf16)."""
    kwargs = dict(cache_dtype=FP8, num_splits=num_splits, max_seq_len=64)
    out, expected = run_decode(DECODE_LENS, 8, 2, 16, 4, dtype, device, **kwargs)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_fp8_cache_matches_reference(device, dtype):
    out, expected = run_prefill(MIXED_BATCH, 8, 2, 16, 4, dtype, device, cache_dtype=FP8)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_launch_reads_no_tensor_values(device):
    """With num_splits and max_seq_len given (as during CUDA-graph capture) the launch must
    not read tensor values on the host: the sequences' different lengths are only seen by
    the kernel, yet each result is right."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [2, 37, 9]
    _, k_cache, v_cache, tables = paged_context(seq_lens, 4, 2, 16, torch.float32, device, gen)
    query = torch.randn(3, 4, 16, generator=gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    with no_host_reads():
        out = paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.25, num_splits=4, max_seq_len=64
        )
    expected = reference(query, k_cache, v_cache, tables, [0, 1, 2, 3], seq_lens, 0.25)
    assert_matches(out, expected, torch.float32)


def test_split_heuristic():
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU
    assert choose_num_splits(256, 8, 8192, cpu) == 1  # the batch fills the GPU
    assert choose_num_splits(1, 8, 8192, cpu) == 32  # long context, one sequence
    assert choose_num_splits(1, 8, 600, cpu) == 3  # no split under 256 tokens
    assert choose_num_splits(1, 8, 1, cpu) == 1
    assert choose_num_splits(1, 1, 10**6, cpu) == 32  # capped


@pytest.mark.parametrize("device", DEVICES)
def test_decode_rejects_bad_arguments(device):
    k_cache = torch.zeros(4, 4, 2, 16, device=device)
    query = torch.zeros(2, 4, 16, device=device)
    tables = torch.zeros(2, 4, dtype=torch.int32, device=device)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(query, k_cache, k_cache, tables, lens, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(query, k_cache, k_cache, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(query, k_cache, k_cache, tables.float(), lens, 1.0)


@needs_cuda
def test_decode_replays_from_a_cuda_graph():
    """Captured once with static bounds, replayed after lengths, block tables and queries
    changed in place (sequences shorter than at capture leave more splits empty)."""
    gen = torch.Generator().manual_seed(4)
    device, dtype = "cuda", torch.bfloat16
    # Every table holds a fully written 64-token context, so any length <= 64 is valid.
    _, k_cache, v_cache, tables = paged_context([64] * 4, 8, 2, 64, dtype, device, gen)
    query = torch.randn(4, 8, 64, generator=gen).to(dtype).to(device)
    lens = torch.tensor([7, 64, 30, 1], dtype=torch.int32, device=device)

    def step() -> torch.Tensor:
        return paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.125, num_splits=4, max_seq_len=128
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_lens in ([7, 64, 30, 1], [64, 3, 1, 50]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        tables.copy_(tables.roll(1, dims=0))
        query.copy_(torch.randn(4, 8, 64, generator=gen).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(query, k_cache, v_cache, tables, [0, 1, 2, 3, 4], new_lens, 0.125)
        assert_matches(out, expected, dtype)


# -- compiled for Hopper, without a GPU ------------------------------------------------------
HOPPER_COMPILE = r'''
import json, re, subprocess, sys, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import paged_decode_attention as dec, paged_prefill_attention as pre
from kernels.reshape_and_cache import _reshape_and_cache_kernel
from kernels import fused_moe as moe

def compile_sm90(fn, pointers, constexprs, num_warps, num_stages):
    """Lower to a cubin for sm_90 as a launch would: aligned pointers and strides, unit
    head_dim strides specialised; report shared memory and ptxas' register/stack use."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            floats = ("qk_scale", "softcap", "alpha", "limit")
            signature[name] = "fp32" if name in floats else "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    tool = triton.__path__[0] + "/backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return dict(name=fn.__name__, shared=kernel.metadata.shared, regs=regs, stack=stack)

# Per-model features, compiled apart: sliding window, Gemma 2's soft-cap, gpt-oss's sinks.
PLAIN = dict(WINDOWED=False, SOFTCAP=False, SINKS=False)
GPT_OSS = dict(WINDOWED=True, SOFTCAP=False, SINKS=True)
GEMMA2 = dict(WINDOWED=True, SOFTCAP=True, SINKS=False)

def decode(dtype, head_dim, group, split, cache=None, features=PLAIN):
    dot = {"bf16": tl.bfloat16, "fp32": tl.float32}[dtype]
    block_n, warps, stages = dec._tile_config(head_dim, dot == tl.float32, cache == "fp8e4nv")
    ptr, kv = "*" + dtype, "*" + (cache or dtype)
    pointers = dict(q_ptr=ptr, k_cache_ptr=kv, v_cache_ptr=kv, block_tables_ptr="*i32",
                    seq_lens_ptr="*i32", out_ptr=ptr, part_out_ptr="*fp32", part_lse_ptr="*fp32",
                    sinks_ptr="*fp32")
    constexprs = dict(stride_qd=1, stride_kd=1, stride_vd=1, GROUP=group,
                      GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                      HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16, BLOCK_N=block_n, SPLIT=split,
                      DOT_DTYPE=dot, DOT_PRECISION="ieee" if dot == tl.float32 else "tf32",
                      **features)
    return compile_sm90(dec._paged_decode_kernel, pointers, constexprs, warps, stages)

def prefill(dtype, head_dim, group, cache=None, features=PLAIN):
    dot = {"bf16": tl.bfloat16, "fp32": tl.float32}[dtype]
    block_m, block_n, warps, stages = pre._tile_config(
        head_dim, dot == tl.float32, cache == "fp8e4nv")
    ptr, kv = "*" + dtype, "*" + (cache or dtype)
    pointers = dict(q_ptr=ptr, k_cache_ptr=kv, v_cache_ptr=kv, block_tables_ptr="*i32",
                    query_start_loc_ptr="*i32", seq_lens_ptr="*i32", out_ptr=ptr,
                    sinks_ptr="*fp32")
    constexprs = dict(stride_qd=1, stride_kd=1, stride_vd=1, GROUP=group, GROUP_PAD=group,
                      HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=16,
                      BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_N=block_n, DOT_DTYPE=dot,
                      DOT_PRECISION="ieee" if dot == tl.float32 else "tf32", **features)
    return compile_sm90(pre._paged_prefill_kernel, pointers, constexprs, warps, stages)

def experts(per_expert, bias, clamped):
    """The fused-MoE kernels (bf16, tensor cores) at the tiles `choose_tiles` picks for
    `per_expert` rows an expert; gpt-oss's biases and clamped SwiGLU, or neither."""
    block_m, block_n, block_k, warps = moe.choose_tiles(per_expert * 8, 8)
    tiles = dict(DOT_DTYPE=tl.bfloat16, PRECISION="tf32", BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k, BIAS=bias)
    ids = dict(sorted_ids_ptr="*i32", block_experts_ptr="*i32")
    gate_up = compile_sm90(moe._gate_up_kernel, dict(x_ptr="*bf16", w_ptr="*bf16",
                           out_ptr="*bf16", bias_ptr="*bf16", **ids),
                           dict(TOP_K=4, CLAMPED=clamped, **tiles), warps, 2)
    down = compile_sm90(moe._down_kernel, dict(h_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                        bias_ptr="*bf16", topk_weights_ptr="*fp32", **ids), tiles, warps, 2)
    return [gate_up, down]

results = [
    *experts(4, False, False),  # decode: few rows an expert
    *experts(100, False, False),  # prefill: the widest tiles
    *experts(100, True, True),  # gpt-oss
    decode("bf16", 128, 4, False),
    decode("bf16", 128, 4, True),
    decode("fp32", 128, 4, True),
    *[compile_sm90(dec._combine_splits_kernel, dict(part_out_ptr="*fp32",
                   part_lse_ptr="*fp32", out_ptr="*bf16", sinks_ptr="*fp32"),
                   dict(HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=32, SINKS=sinks), 4, 1)
      for sinks in (False, True)],
    # gpt-oss: head_dim 64, 8 query heads per KV head, windowed layers with sinks
    decode("bf16", 64, 8, False, features=GPT_OSS),
    decode("bf16", 64, 8, True, features=GPT_OSS),
    prefill("bf16", 64, 8, features=GPT_OSS),
    # Gemma 2: head_dim 256, 2 query heads per KV head, windowed and soft-capped
    decode("bf16", 256, 2, True, features=GEMMA2),
    prefill("bf16", 256, 2, features=GEMMA2),
    prefill("bf16", 128, 4),
    prefill("bf16", 64, 8),
    prefill("fp32", 128, 4),
    *[compile_sm90(_reshape_and_cache_kernel, dict(key_ptr="*bf16", value_ptr="*bf16",
                   k_cache_ptr=cache, v_cache_ptr=cache, slot_mapping_ptr="*i64"),
                   dict(stride_kd=1, stride_vd=1, stride_kcd=1, stride_vcd=1, NUM_HEADS=8,
                        HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128), 4, 1)
      for cache in ("*bf16", "*fp8e4nv")],
    # fp8 (e4m3fn) caches: bf16 queries (tensor cores) and fp32 queries (one stage)
    decode("bf16", 128, 4, True, "fp8e4nv"),
    decode("fp32", 128, 4, True, "fp8e4nv"),
    prefill("bf16", 128, 4, "fp8e4nv"),
    prefill("fp32", 128, 4, "fp8e4nv"),
]
print(json.dumps(results))
'''


@pytest.mark.skipif(
    not (Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "ptxas").exists(),
    reason="this Triton wheel bundles no ptxas",
)
def test_kernels_compile_for_hopper_without_spills():
    """The production configurations (bf16/fp32, head_dim 128, GQA; also over an fp8 cache;
    gpt-oss's windowed sink attention, Gemma 2's soft-capped one; the fused-MoE kernels,
    plain and gpt-oss's) lower through Triton's sm_90 pipeline and ptxas (both bundled with
    the wheel, no GPU needed), fit Hopper's shared memory and keep everything in registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", HOPPER_COMPILE],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for kernel in json.loads(result.stdout.strip().splitlines()[-1]):
        assert kernel["stack"] == 0, kernel  # no register spills
        assert kernel["shared"] <= 227 * 1024, kernel
        assert kernel["regs"] <= 255, kernel
