"""The Triton fused mixture-of-experts (`kernels/fused_moe.py`) against the model's own
`moe.fused_experts` (HF layout) and a per-token, per-choice loop in float64.

Without CUDA the kernels run under the Triton CPU interpreter (selected below, before the
kernel module is imported) on tiny shapes; with CUDA the same tests run compiled on the GPU,
plus the CUDA-graph safety check. Shapes are chosen for the edges: `HIDDEN` = 80 is one
whole and one partial 64-wide tile (the gate/up reduction, the down output), `INNER` = 40
one partial tile; token counts that are not multiples of the 16-row block; experts nobody
routes to hold NaN weights, so a program that reads one poisons the result.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel definitions

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.fused_moe import choose_tiles, fused_moe  # noqa: E402
from services.worker.models.moe import fused_experts  # noqa: E402
from tests.gpu.graph_safety import no_host_reads  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
HIDDEN, INNER = 80, 40
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


def random_ids(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token, as top-k gives."""
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


def layer(experts: int, gen: torch.Generator, dtype=torch.float32):
    """Stacked expert weights in HF's layout: gate_up [E, 2I, HIDDEN], down [E, HIDDEN, INNER]."""
    gate_up = torch.randn(experts, 2 * INNER, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(experts, HIDDEN, INNER, generator=gen) / INNER**0.5
    return gate_up.to(dtype), down.to(dtype)


def per_token(x, gate_up, down, weights, ids, offset: int = 0, held: int | None = None):
    """The layer token by token, choice by choice, in float64 (experts outside
    `[offset, offset + held)` skipped)."""
    held = gate_up.shape[0] if held is None else held
    x, gate_up, down, weights = (t.double().cpu() for t in (x, gate_up, down, weights))
    out = torch.zeros_like(x)
    for t, row in enumerate(ids.tolist()):
        for j, expert in enumerate(row):
            if not offset <= expert < offset + held:
                continue
            gate, up = (gate_up[expert - offset] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[expert - offset] @ (F.silu(gate) * up))
    return out


def close(actual: torch.Tensor, expected: torch.Tensor, dtype=torch.float32, exact=False):
    """`actual` against a reference (the model's path, or the float64 loop) within `dtype`'s
    tolerance, or bit for bit."""
    tolerance = dict(rtol=0, atol=0) if exact else TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), **tolerance)


def run(x, gate_up, down, weights, ids, **kwargs) -> torch.Tensor:
    on = [t.to(DEVICE) for t in (x, gate_up, down, weights, ids)]
    out = fused_moe(*on, **kwargs)
    assert out.dtype == x.dtype and out.shape == x.shape
    return out.cpu()


CASES = {  # name: (tokens, experts, top_k)
    "decode": (1, 8, 2),
    "ragged": (37, 4, 2),  # 74 rows: several blocks per expert, the last ones partial
    "top1": (20, 6, 1),
    "every_expert": (9, 3, 3),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_fused_experts_and_per_token(case: str) -> None:
    tokens, experts, top_k = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(tokens, HIDDEN, generator=gen)
    gate_up, down = layer(experts, gen)
    ids = random_ids(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    out = run(x, gate_up, down, weights, ids)
    close(out, fused_experts(x, gate_up, down, weights, ids, False))
    close(out, per_token(x, gate_up, down, weights, ids))


def test_few_experts_others_never_read() -> None:
    """40 tokens all routed to experts 1 and 4 of 6 (40 rows each: two whole blocks and a
    partial one); the four experts without tokens hold NaN."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, HIDDEN, generator=gen)
    gate_up, down = layer(6, gen)
    for empty in (0, 2, 3, 5):
        gate_up[empty], down[empty] = float("nan"), float("nan")
    first = torch.rand(40, generator=gen) < 0.3
    ids = torch.stack([torch.where(first, 1, 4), torch.where(first, 4, 1)], dim=1)
    weights = torch.rand(40, 2, generator=gen)
    out = run(x, gate_up, down, weights, ids)
    assert out.isfinite().all()
    close(out, fused_experts(x, gate_up, down, weights, ids, False))
    close(out, per_token(x, gate_up, down, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    """16-bit activations and weights against the model's path in the same dtype (its
    rounding points differ: gate/up rounded before silu) and the float64 loop over the same
    rounded inputs; Qwen3-MoE's weights cast to the dtype, Mixtral's float32 ones."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, HIDDEN, generator=gen).to(dtype)
    gate_up, down = layer(4, gen, dtype)
    ids = random_ids(37, 4, 2, gen)
    weights = torch.rand(37, 2, generator=gen)
    out = run(x, gate_up, down, weights.to(dtype), ids)
    reference = fused_experts(x, gate_up, down, weights.to(dtype), ids, False)
    close(out, reference, dtype)
    out = run(x, gate_up, down, weights, ids)
    exact = per_token(x, gate_up, down, weights, ids)
    close(out, exact, dtype)


@pytest.mark.parametrize(("offset", "held"), [(0, 3), (3, 3), (6, 2)])
def test_expert_range(offset: int, held: int) -> None:
    """A rank holding experts [offset, offset + held) of 8 computes their assignments only:
    equal to the whole layer with the other assignments' weights zeroed."""
    gen = torch.Generator().manual_seed(offset)
    x = torch.randn(23, HIDDEN, generator=gen)
    gate_up, down = layer(8, gen)
    ids = random_ids(23, 8, 2, gen)
    weights = torch.rand(23, 2, generator=gen)
    mine = slice(offset, offset + held)
    out = run(x, gate_up[mine], down[mine], weights, ids, expert_offset=offset)
    close(out.double(), per_token(x, gate_up[mine], down[mine], weights, ids, offset))
    held_mask = (ids >= offset) & (ids < offset + held)
    masked = fused_experts(x, gate_up, down, weights * held_mask, ids, False)
    close(out, masked)
    # Holding more experts than the range names: the extra ones are skipped too.
    wider = slice(offset, 8)
    out_wider = run(
        x, gate_up[wider], down[wider], weights, ids, expert_offset=offset, num_local_experts=held
    )
    close(out_wider, out, exact=True)


def test_ranks_sum_to_the_whole_layer() -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(17, HIDDEN, generator=gen)
    gate_up, down = layer(8, gen)
    ids = random_ids(17, 8, 2, gen)
    weights = torch.rand(17, 2, generator=gen)
    whole = run(x, gate_up, down, weights, ids)
    parts = [
        run(x, gate_up[a:b], down[a:b], weights, ids, expert_offset=a)
        for a, b in ((0, 3), (3, 6), (6, 8))
    ]
    close(sum(parts), whole)
    # A range nobody routes to contributes nothing.
    nobody = run(x, gate_up[:2], down[:2], weights, torch.full_like(ids, 5), expert_offset=0)
    assert (nobody == 0).all()


def test_strided_inputs_and_block_m() -> None:
    """x a column slice of a NaN-padded buffer, the weights transposed views (neither
    contiguous), int32 ids; a 32-row block; and no tokens at all."""
    gen = torch.Generator().manual_seed(7)
    buffer = torch.full((19, HIDDEN + 8), float("nan"))
    buffer[:, 8:] = torch.randn(19, HIDDEN, generator=gen)
    x = buffer[:, 8:]
    gate_up, down = layer(5, gen)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not gate_up_t.is_contiguous() and not down_t.is_contiguous()
    ids = random_ids(19, 5, 2, gen).int()
    weights = torch.rand(19, 2, generator=gen)
    expected = per_token(x, gate_up, down, weights, ids)
    for block_m in (16, 32):
        out = run(x, gate_up_t, down_t, weights, ids, block_m=block_m)
        close(out, expected)
    empty = run(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, HIDDEN)


def test_tiles_by_shape() -> None:
    block_m, block_n, block_k, _ = choose_tiles(74, 4)
    assert block_m >= 16 and block_n >= 16 and block_k >= 16  # tl.dot's minimum


@needs_cuda
def test_launch_reads_no_tensor_values() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, HIDDEN, generator=gen).to(DEVICE)
    gate_up, down = (t.to(DEVICE) for t in layer(4, gen))
    ids = random_ids(37, 4, 2, gen).to(DEVICE)
    weights = torch.rand(37, 2, generator=gen).to(DEVICE)
    with no_host_reads():
        fused_moe(x, gate_up, down, weights, ids, expert_offset=1, num_local_experts=3)


def test_rejects_bad_arguments() -> None:
    x, ids, weights = torch.zeros(4, HIDDEN), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2)
    gate_up, down = torch.zeros(3, 2 * INNER, HIDDEN), torch.zeros(3, HIDDEN, INNER)
    with pytest.raises(ValueError, match="down must be"):
        fused_moe(x, gate_up, down[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="weights must be"):
        fused_moe(x, gate_up.half(), down.half(), weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, gate_up, down, weights[:, :1], ids)
    with pytest.raises(ValueError, match="integers"):
        fused_moe(x, gate_up, down, weights, weights)
    with pytest.raises(ValueError, match="expert range"):
        fused_moe(x, gate_up, down, weights, ids, num_local_experts=4)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe(x, gate_up, down, weights, ids, block_m=24)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.double(), gate_up.double(), down.double(), weights, ids)


@needs_cuda
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_moe_layer_on_the_gpu_runs_the_kernel_and_equals_hf(kind) -> None:
    """`moe.SparseMoeBlock` on a CUDA device routes through this kernel (the CPU path is
    `fused_experts`), and its output equals HF's block on the same device."""
    from tests.unit.test_moe import HIDDEN, hf_block, ours_like

    block, moe = hf_block(kind, 8, 2, True, seed=21)
    ours = ours_like(block, moe, kind, transposed=False).to("cuda")
    block = block.to("cuda")
    x = torch.randn(19, HIDDEN, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
