"""The Triton batched multi-LoRA kernels (`kernels.lora_triton`) against an independent
per-token computation from each slot's unpadded matrices (which also checks the torch
reference, `kernels.lora_reference`), and `LoraLinear`'s Triton path against its torch path.

Without CUDA the kernels run under the Triton CPU interpreter (selected below, before the
kernel modules are imported) on tiny shapes; with CUDA the same tests run compiled, plus
fp16 and a CUDA-graph replay. Batches mix base tokens (-1), unsorted slots, a slot without
tokens and ranks below the padded R; inputs and outputs are strided views.
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
from torch import nn  # noqa: E402

from kernels.lora_reference import add_lora_reference  # noqa: E402
from kernels.lora_triton import add_lora, choose_split_k  # noqa: E402
from services.worker.lora.adapter import LoraAdapter  # noqa: E402
from services.worker.lora.layers import LoraContext, LoraLinear  # noqa: E402
from services.worker.models.linear import MergedLinear  # noqa: E402
from tests.gpu.graph_safety import no_host_reads  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}
T, IN, OUT, R = 20, 136, 48, 16  # IN: 3 shrink blocks of 64, the last partial
RANKS = (16, 5, 9)  # slot 2 gets no tokens
TOKEN_SLOTS = [1, -1, 0, 0, 1, -1, 1, 0, 0, 0, -1, 1, 1, 0, -1, -1, 0, 1, 0, 1]


def slot_weights(dtype, gen: torch.Generator, junk_padding: bool = False):
    """Each slot's unpadded (A [in, r], B [r, out]) and the stacked [S, in, R] / [S, R, out]
    (zero-padded, or NaN-padded with `junk_padding`: only `slot_ranks` may hide it)."""
    pad = float("nan") if junk_padding else 0.0
    lora_a = torch.full((len(RANKS), IN, R), pad)
    lora_b = torch.full((len(RANKS), R, OUT), pad)
    unpadded = []
    for s, rank in enumerate(RANKS):
        a = (torch.randn(IN, rank, generator=gen) / IN**0.5).to(dtype)
        b = (torch.randn(rank, OUT, generator=gen) / rank**0.5).to(dtype)
        lora_a[s, :, :rank], lora_b[s, :rank] = a.float(), b.float()
        unpadded.append((a, b))
    return unpadded, lora_a.to(dtype).to(DEVICE), lora_b.to(dtype).to(DEVICE)


def strided_inputs(dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, IN] and out [T, OUT] as column slices of wider tensors (row stride > width)."""
    x = torch.randn(T, IN + 8, generator=gen).to(dtype).to(DEVICE)[:, 8:]
    out = torch.randn(T, OUT + 16, generator=gen).to(dtype).to(DEVICE)[:, :OUT]
    return x, out


def per_token(x, out, token_slots, unpadded) -> torch.Tensor:
    """out[t] + x[t] @ A_s @ B_s token by token in float64, from the unpadded matrices."""
    expected = out.double().cpu().clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            a, b = unpadded[s]
            expected[t] += x[t].double().cpu() @ a.double() @ b.double()
    return expected


def assert_matches(actual, expected, dtype) -> None:
    torch.testing.assert_close(actual.double().cpu(), expected, **TOLERANCE[dtype])


DTYPES = [
    torch.float32,
    torch.bfloat16,
    pytest.param(torch.float16, marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2, 4, None])  # 4: one split empty
def test_add_lora_matches_per_token_math(dtype, split_k):
    gen = torch.Generator().manual_seed(0)
    unpadded, lora_a, lora_b = slot_weights(dtype, gen)
    x, out = strided_inputs(dtype, gen)
    slots = torch.tensor(TOKEN_SLOTS, device=DEVICE)
    expected = per_token(x, out, TOKEN_SLOTS, unpadded)
    before = out.clone()

    result = add_lora(x, out, slots, lora_a, lora_b, split_k=split_k)
    assert result is out
    assert_matches(out, expected, dtype)
    base = slots < 0
    assert torch.equal(out[base], before[base])  # base tokens untouched, bit for bit
    assert_matches(add_lora_reference(x, before.clone(), slots, lora_a, lora_b), expected, dtype)


def test_slot_ranks_skip_the_padding_and_rank_zero_slots():
    """With `slot_ranks`, padding beyond a slot's rank is never read (NaN there would show),
    and a rank-0 slot adds nothing to its tokens."""
    gen = torch.Generator().manual_seed(1)
    unpadded, lora_a, lora_b = slot_weights(torch.float32, gen, junk_padding=True)
    x, out = strided_inputs(torch.float32, gen)
    token_slots = [s if s != 1 else 2 for s in TOKEN_SLOTS[:10]] + TOKEN_SLOTS[10:]
    slots = torch.tensor(token_slots, dtype=torch.int32, device=DEVICE)
    ranks = torch.tensor([RANKS[0], RANKS[1], 0], dtype=torch.int32, device=DEVICE)
    expected = per_token(x, out, [s if s != 2 else -1 for s in token_slots], unpadded)
    reference = add_lora_reference(x, out.clone(), slots, lora_a, lora_b, slot_ranks=ranks)
    assert_matches(reference, expected, torch.float32)
    add_lora(x, out, slots, lora_a, lora_b, slot_ranks=ranks, split_k=2)
    assert_matches(out, expected, torch.float32)


def test_nothing_to_add():
    gen = torch.Generator().manual_seed(2)
    _, lora_a, lora_b = slot_weights(torch.float32, gen)
    x, out = strided_inputs(torch.float32, gen)
    before = out.clone()
    add_lora(x, out, torch.full((T,), -1, device=DEVICE), lora_a, lora_b)
    assert torch.equal(out, before)
    empty = torch.zeros(0, OUT, device=DEVICE)
    add_lora(x[:0], empty, torch.zeros(0, dtype=torch.long, device=DEVICE), lora_a, lora_b)


def test_launch_reads_no_tensor_values():
    gen = torch.Generator().manual_seed(3)
    unpadded, lora_a, lora_b = slot_weights(torch.float32, gen)
    x, out = strided_inputs(torch.float32, gen)
    expected = per_token(x, out, TOKEN_SLOTS, unpadded)
    slots = torch.tensor(TOKEN_SLOTS, dtype=torch.int32, device=DEVICE)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEVICE)
    with no_host_reads():
        add_lora(x, out, slots, lora_a, lora_b, slot_ranks=ranks)
    assert_matches(out, expected, torch.float32)


def test_rejects_bad_arguments():
    x, out = torch.zeros(4, IN), torch.zeros(4, OUT)
    a, b, slots = torch.zeros(2, IN, R), torch.zeros(2, R, OUT), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit"):
        add_lora(x, out, slots, a, b[:, :8])
    with pytest.raises(ValueError, match="token_slots"):
        add_lora(x, out, slots[:3], a, b)
    with pytest.raises(ValueError, match="slot_ranks"):
        add_lora(x, out, slots, a, b, slot_ranks=torch.zeros(2))
    with pytest.raises(ValueError, match="dtype"):
        add_lora(x.double(), out, slots, a, b)
    with pytest.raises(ValueError, match="split_k"):
        add_lora(x, out, slots, a, b, split_k=0)


def test_split_heuristic():
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU
    assert choose_split_k(1, 4096, 64, cpu) == 16  # decode: one token tile, long reduction
    assert choose_split_k(1, 136, 64, cpu) == 1  # too little to split
    assert choose_split_k(200, 4096, 64, cpu) == 1  # the token tiles fill the GPU


# -- LoraLinear: the Triton path equals the torch path ---------------------------------------
PARTS, SIZES = ("q_proj", "k_proj", "v_proj"), (32, 16, 16)


def adapter(name, rank, scaling, parts, gen) -> LoraAdapter:
    weights = {}
    for part in parts:
        size = SIZES[PARTS.index(part)]
        a, b = torch.randn(rank, IN, generator=gen), torch.randn(size, rank, generator=gen)
        weights[(0, part)] = (a, b / rank)
    return LoraAdapter(name, rank, scaling, weights)


def merged_update(x, lora: LoraAdapter) -> torch.Tensor:
    """x's update by `lora` on the merged q/k/v output, part by part in float64."""
    columns = []
    for part, size in zip(PARTS, SIZES, strict=True):
        pair = lora.weights.get((0, part))
        if pair is None:
            columns.append(torch.zeros(x.shape[0], size, dtype=torch.float64))
        else:
            a, b = pair
            columns.append(lora.scaling * x.double() @ a.double().t() @ b.double().t())
    return torch.cat(columns, dim=1)


def test_lora_linear_triton_path_equals_torch_path():
    gen = torch.Generator().manual_seed(5)
    layers = [nn.Linear(IN, size, bias=False, device=DEVICE) for size in SIZES]
    base = MergedLinear.merge(layers)
    qv = adapter("qv", 4, 2.0, ("q_proj", "v_proj"), gen)
    qkv = adapter("qkv", 8, 0.5, PARTS, gen)
    other = adapter("o-only", 8, 1.0, (), gen)  # targets nothing here: rank 0
    context = LoraContext()
    paths = {
        use: LoraLinear(base, PARTS, context, num_slots=3, max_rank=8, use_triton=use)
        for use in (False, True)
    }
    for lora in paths.values():
        lora.set_slot(2, qkv, 0)
        lora.set_slot(2, qv, 0)  # refilled: qkv's k part and wider rank must be gone
        lora.set_slot(0, qkv, 0)
        lora.set_slot(1, other, 0)
    assert paths[True].slot_ranks.tolist() == [24, 0, 8]
    assert not paths[True].lora_a[2, :, 8:].any() and not paths[True].lora_b[2, 8:].any()
    token_slots = [2, -1, 0, 0, 2, 1, -1, 0, 2, 2, 0, -1, 1]
    x = torch.randn(len(token_slots), IN, generator=gen).to(DEVICE)
    context.set(token_slots, DEVICE)
    with torch.no_grad():
        outputs = {use: lora(x).cpu() for use, lora in paths.items()}
        expected = base(x).double().cpu()
    by_slot = {0: qkv, 2: qv}
    for t, s in enumerate(token_slots):
        if s in by_slot:
            expected[t] += merged_update(x[t : t + 1].cpu(), by_slot[s])[0]
    torch.testing.assert_close(outputs[False].double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outputs[True].double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outputs[True], outputs[False], atol=1e-4, rtol=1e-4)
    context.clear()
    with torch.no_grad():
        assert torch.equal(paths[True](x), base(x))  # no pass set: the base model


@needs_cuda
def test_add_lora_replays_from_a_cuda_graph():
    """Captured once, replayed after the tokens' slots and inputs changed in place."""
    gen = torch.Generator().manual_seed(6)
    dtype = torch.bfloat16
    unpadded, lora_a, lora_b = slot_weights(dtype, gen)
    x, out = strided_inputs(dtype, gen)
    start = out.clone()
    slots = torch.tensor(TOKEN_SLOTS, device=DEVICE)
    order = torch.empty_like(slots)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEVICE)

    def step() -> None:
        out.copy_(start)
        order.copy_(torch.argsort(slots, stable=True))
        add_lora(x, out, slots, lora_a, lora_b, token_order=order, slot_ranks=ranks)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for shift in (0, 3):
        new_slots = TOKEN_SLOTS[shift:] + TOKEN_SLOTS[:shift]
        slots.copy_(torch.tensor(new_slots))
        x.copy_(torch.randn(T, IN, generator=gen).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, per_token(x, start, new_slots, unpadded), dtype)


# -- compiled for Hopper, without a GPU ------------------------------------------------------
HOPPER_COMPILE = r"""
import json, re, subprocess, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import lora_triton as lt

def compile_sm90(fn, pointers, constexprs):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=4, num_stages=3))
    tool = triton.__path__[0] + "/backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return dict(name=fn.__name__, shared=kernel.metadata.shared, regs=regs, stack=stack)

def config(dtype, split, block_m, block_r):
    dot = {"bf16": tl.bfloat16, "fp32": tl.float32}[dtype]
    return dict(HAS_RANKS=True, SPLIT_K=split, BLOCK_M=block_m, BLOCK_R=block_r,
                DOT_DTYPE=dot, PRECISION="ieee" if dtype == "fp32" else "tf32")

def shrink(dtype, split, block_m, block_r, block_k):
    ptr = "*" + dtype
    pointers = dict(x_ptr=ptr, a_ptr=ptr, y_ptr="*fp32", slots_ptr="*i32", order_ptr="*i32",
                    ranks_ptr="*i32")
    constexprs = dict(stride_xk=1, stride_ar=1, BLOCK_K=block_k,
                      **config(dtype, split, block_m, block_r))
    return compile_sm90(lt._shrink_kernel, pointers, constexprs)

def expand(dtype, split, block_m, block_r, block_n):
    ptr = "*" + dtype
    pointers = dict(y_ptr="*fp32", b_ptr=ptr, out_ptr=ptr, slots_ptr="*i32", order_ptr="*i32",
                    ranks_ptr="*i32")
    constexprs = dict(stride_bn=1, stride_on=1, BLOCK_N=block_n,
                      **config(dtype, split, block_m, block_r))
    return compile_sm90(lt._expand_kernel, pointers, constexprs)

print(json.dumps([
    shrink("bf16", 16, 16, 16, 64),  # decode, rank 16, split
    shrink("bf16", 1, 32, 256, 32),  # prefill, q/k/v at rank 64 (R 192)
    shrink("fp32", 1, 64, 64, 64),
    expand("bf16", 16, 16, 64, 128),
    expand("bf16", 1, 64, 64, 128),
    expand("fp32", 1, 64, 64, 64),
]))
"""


@pytest.mark.skipif(
    not (Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "ptxas").exists(),
    reason="this Triton wheel bundles no ptxas",
)
def test_kernels_compile_for_hopper_without_spills():
    """Decode- and prefill-sized tile configurations lower through Triton's sm_90 pipeline
    and ptxas (both bundled with the wheel, no GPU needed) without spilling registers."""
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
