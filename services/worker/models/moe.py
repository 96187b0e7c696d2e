"""The mixture-of-experts feed-forward of Mixtral and Qwen3-MoE over a flat batch of tokens.

`route` is Hugging Face's top-k router: softmax over the router logits in float32, the top k
experts per token, their weights renormalised to sum to 1 where the model says so (Mixtral
always, Qwen3-MoE per `norm_topk_prob`). `fused_experts` then computes every (token, expert)
assignment of the batch at once, without a loop over tokens: one stable argsort groups the
assignments by expert, each expert that has tokens runs gate/up, `silu(gate) * up` and down
as one matrix product over its rows, each row is scaled by its routing weight, and one
`index_add_` sums each token's k rows into its output. Rows are summed in ascending expert
order, the order of HF's loop over experts, and in the same dtypes (Mixtral scales by the
float32 weights and casts the product; Qwen3-MoE casts the weights to the activations'
dtype first), so results equal HF's to float rounding. gpt-oss's experts (`gpt_oss.py`) have
biases, added right after each product as HF adds them, and their own activation on the
gate/up product (`activation`: any `[.., 2I] -> [.., I]` function of the gate half and the
up half; silu(gate) * up by default, gpt-oss's `ClampedSwiGLU`).

`SparseMoeBlock` holds a layer's router (`gate`, applied with `F.linear` as HF does: the
routing decision sees the same logits) and its experts stacked per layer, with the names and
layouts of HF's v5 modules: `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
`experts.down_proj` [E, H, I] (checkpoints that store one tensor per expert are stacked into
these by `expert_weights.py`). After loading, `merge_projections` lays them out for the
device: on CPU transposed to [E, H, 2I] / [E, I, H], so each product is `x @ W`, the layout
MKL multiplies fastest (as `linear.py` does for the dense layers); elsewhere they stay.
On CPU each expert also gets two `ExpertProjection`s (gate/up, down): `MergedLinear`s over
views of those stacked weights, so `LlamaForCausalLM.pack_weights` packs them with the dense
layers, in the format and for the row counts its plan names (issue 43: on the 2-core EPYC a
c16 decode step of qwen3-moe-tiny took 25 -> 11 ms with Tandem's panels in the huge-page
arena, the experts' part of it 17 -> 6 ms: `bench.moe_step`).
On a GPU the layer runs `kernels.fused_moe` (Triton: one grouped GEMM over every expert's
tokens for gate/up, one for down, with gpt-oss's biases and `ClampedSwiGLU` where the
experts have them; tested under the interpreter only so far). Unmerged on
CPU, the products are plain torch ones (`torch.mm`, or `F.linear` in HF's layout). The
routing weights scale all grouped rows in one product after the loop.

Tensor parallelism: each rank holds every expert's slice of the inner dimension (rows of
gate/up, columns of down, as the dense MLP) and the whole router, so every rank routes
every token the same way; the block's partial output is summed over the group with one
all-reduce, as the dense MLP's is. Expert parallelism (`--enable-expert-parallel`, vLLM's
flag): each rank holds 1/size of the experts whole instead, routes every token (the router
is whole), computes the assignments to its own experts only and skips the rest; the same
all-reduce then sums each token's experts from every rank (the combine; the dispatch is
free since every rank already has every token: attention is tensor-parallel).

DeepSeek-V2 / V3 (`SharedExpertMoeBlock`): the same experts behind DeepSeek's routers
(`grouped_route`, transformers' `DeepseekV2TopkRouter` / `DeepseekV3TopkRouter` step for
step: float32 logits, V3's sigmoid with `e_score_correction_bias` for the choice and its
group-limited top-k, V2's softmax greedy or group-limited, `routed_scaling_factor`), each
expert's output scaled by the float32 weights, plus the always-on shared experts (one
SwiGLU MLP, `shared_experts`), added before the block's one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.moe_config import SIGMOID_GROUPS, SOFTMAX_GROUPS, MoeConfig
from services.worker.models.activation import silu_and_mul
from services.worker.models.gemm_plan import PLAIN
from services.worker.models.linear import MergedLinear
from services.worker.sharding.tp_group import TpGroup


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, E]` router logits -> (float32 weights `[T, k]`, expert ids `[T, k]`), HF's way:
    softmax in float32, top k (largest first), optionally divided by their sum."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, experts


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: `gate_up` [..., 2I] (gate, then up) -> (up + 1) * g *
    sigmoid(alpha * g) [..., I], g = min(gate, limit), up clamped to [-limit, limit]
    (transformers' `GptOssExperts._apply_gate`, on gate and up halves instead of its
    interleaved columns)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    transposed: bool,
    projections: Sequence[tuple[MergedLinear, MergedLinear]] | None = None,
    first_expert: int | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """`sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over `e = experts[t, j]`,
    for every token `t` of `x` `[T, H]`. `gate_up` / `down`: every expert's matrices, stacked,
    as HF stores them (`[E, 2I, H]`, `[E, H, I]`) or, `transposed`, as `[E, H, 2I]`,
    `[E, I, H]`. `projections`: per expert, its (gate/up, down) layers over those transposed
    matrices, which may hold packed copies (`ExpertProjection`); they then run the products.
    The products run in `x`'s dtype; the scaled rows are cast back to it. With expert
    parallelism the stacked matrices are experts `first_expert ..` only (None: every expert):
    the assignments to other experts are skipped (another rank computes them; the group's
    sum adds them). `biases`: the held experts' gate/up `[E, 2I]` and down `[E, H]` biases,
    each added to its product; `activation`: `[rows, 2I] -> [rows, I]` in place of
    `silu_and_mul`."""
    num_tokens, top_k = experts.shape
    held = gate_up.shape[0]
    flat = experts.reshape(-1)
    if first_expert is not None:
        picked = ((flat >= first_expert) & (flat < first_expert + held)).nonzero().squeeze(1)
        local = flat.index_select(0, picked) - first_expert
        order = picked.index_select(0, torch.argsort(local, stable=True))
        counts = torch.bincount(local, minlength=held).tolist()
    else:
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, in order
        counts = torch.bincount(flat, minlength=held).tolist()
    tokens = order // top_k  # the token of each grouped assignment
    rows = x.index_select(0, tokens)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        layers = projections[expert] if projections is not None else None
        h = rows[start:end]
        h = layers[0](h) if layers else _product(h, gate_up[expert], transposed)
        if biases is not None:
            h = h + biases[0][expert]
        h = activation(h)
        h = layers[1](h) if layers else _product(h, down[expert], transposed)
        out[start:end] = h if biases is None else h + biases[1][expert]
        start = end
    # Every row scaled at once (the same elementwise products as per expert; with float32
    # weights over lower-precision rows the product is computed in float32, then cast back).
    out.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(-1))
    return torch.zeros_like(x).index_add_(0, tokens, out)


def _product(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return torch.mm(x, weight) if transposed else F.linear(x, weight)


class ExpertProjection(MergedLinear):
    """One expert's gate/up (`[H, 2I]`) or down (`[I, H]`) product on CPU over a view of the
    layer's stacked transposed weights (no copy of its own, and no parameter: the stacked
    tensors stay the layer's). Being a `MergedLinear`, `LlamaForCausalLM.pack_weights` finds
    it among the dense layers and gives it a packed copy in the model's format (in the huge-
    page weight arena for Tandem's panels), used at the row counts the plan names."""

    def __init__(self, weight_t: torch.Tensor) -> None:
        nn.Module.__init__(self)
        if not weight_t.is_contiguous():
            raise ValueError("an expert projection needs a contiguous [in, out] weight")
        self.transposed = True
        self.weight = weight_t  # a plain attribute: a view, not a parameter of this module
        self.bias = None
        self.sizes = (weight_t.shape[1],)
        self.out_features = weight_t.shape[1]
        self.packed = None
        self.plan = PLAIN
        self.blocks = None


class Experts(nn.Module):
    """One layer's experts, stacked: those this rank holds (`first_expert` onwards; None: all
    of them), each's inner dimension or this rank's slice of it. `bias`: with HF's
    `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H] (gpt-oss); `activation`: of the
    gate/up product (`fused_experts`)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inner: int,
        dtype: torch.dtype,
        first_expert: int | None = None,
        bias: bool = False,
        activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    ) -> None:
        super().__init__()
        self.first_expert = first_expert
        self.activation = activation
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(
                torch.empty(num_experts, 2 * inner, dtype=dtype), requires_grad=False
            )
            self.down_proj_bias = nn.Parameter(
                torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False
            )
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * inner, hidden, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, inner, dtype=dtype), requires_grad=False
        )
        self.transposed = False
        self.projections: nn.ModuleList | None = None  # CPU: per expert, gate/up then down

    def merge_projections(self) -> None:
        """Lay the loaded weights out for the device (idempotent): transposed on CPU, with
        one `ExpertProjection` pair per expert over views of them."""
        if self.transposed or self.gate_up_proj.device.type != "cpu":
            return
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name).detach().transpose(1, 2).contiguous()
            setattr(self, name, nn.Parameter(weight, requires_grad=False))
        self.transposed = True
        self.projections = nn.ModuleList(
            nn.ModuleList([ExpertProjection(gate_up), ExpertProjection(down)])
            for gate_up, down in zip(
                self.gate_up_proj.detach(), self.down_proj.detach(), strict=True
            )
        )

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        biases = None
        if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
            biases = (self.gate_up_proj_bias, self.down_proj_bias)
        clamped = isinstance(self.activation, ClampedSwiGLU)
        if x.device.type == "cuda" and (clamped or self.activation is silu_and_mul):
            from kernels.fused_moe import fused_moe  # one grouped-GEMM launch per projection

            swiglu = (self.activation.alpha, self.activation.limit) if clamped else None
            return fused_moe(
                x, self.gate_up_proj, self.down_proj, weights, experts,
                expert_offset=self.first_expert or 0,
                gate_up_bias=None if biases is None else biases[0],
                down_bias=None if biases is None else biases[1],
                swiglu_clamp=swiglu,
            )  # fmt: skip
        return fused_experts(
            x,
            self.gate_up_proj,
            self.down_proj,
            weights,
            experts,
            self.transposed,
            self.projections,
            self.first_expert,
            biases,
            self.activation,
        )


class SparseMoeBlock(nn.Module):
    """Router plus experts: HF's `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock` over a
    flat `[T, hidden]` batch. `inner`: this rank's slice of the expert inner size; `experts`:
    the experts this rank holds (None: all). `float32_weights`: scale expert outputs by the
    float32 routing weights (Mixtral) rather than by the weights cast to the activations'
    dtype (Qwen3-MoE)."""

    def __init__(
        self,
        hidden: int,
        moe: MoeConfig,
        inner: int,
        dtype: torch.dtype,
        tp: TpGroup | None = None,
        float32_weights: bool = False,
        experts: range | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TpGroup()
        self.top_k, self.renormalize = moe.num_experts_per_tok, moe.norm_topk_prob
        self.float32_weights = float32_weights
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False, dtype=dtype)
        held = range(moe.num_experts) if experts is None else experts
        first = None if len(held) == moe.num_experts else held.start
        self.experts = Experts(len(held), hidden, inner, dtype, first)

    def merge_projections(self) -> None:
        self.experts.merge_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        return self.tp.all_reduce(self.experts(x, weights, experts))


def grouped_route(
    router_logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing of float32 router logits `[T, E]` -> (float32 weights `[T, k]`,
    expert ids `[T, k]`), in transformers' operations (`moe.routing`: V3's sigmoid over the
    best groups, choosing by score + `bias`; V2's softmax, greedy or over the best groups),
    times `routed_scaling_factor`."""
    top_k, groups = moe.num_experts_per_tok, moe.n_group
    per_group = moe.num_experts // groups
    if moe.routing == SIGMOID_GROUPS:
        scores = router_logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(-1, groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~_group_mask(group_scores, moe), float("-inf"))
        experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if moe.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    else:
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
        if moe.routing == SOFTMAX_GROUPS:
            group_scores = scores.view(-1, groups, per_group).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(group_scores, moe), 0.0)
        weights, experts = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * moe.routed_scaling_factor, experts


def _group_mask(group_scores: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """`[T, E]` True for the experts of each token's `topk_group` best groups."""
    group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    per_group = moe.num_experts // moe.n_group
    expanded = group_mask.unsqueeze(-1).expand(-1, moe.n_group, per_group)
    return expanded.reshape(-1, moe.num_experts).bool()


class TopkRouter(nn.Module):
    """DeepSeek's router (HF's `mlp.gate`): `weight` [E, H] applied in float32, and V3's
    float32 `e_score_correction_bias` [E] (None for V2)."""

    def __init__(self, hidden: int, moe: MoeConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=dtype))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32), requires_grad=False)
            if moe.routing == SIGMOID_GROUPS
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class SharedExpertMoeBlock(SparseMoeBlock):
    """HF's `DeepseekV2Moe` / `DeepseekV3MoE` over a flat `[T, hidden]` batch: routed experts
    (`grouped_route`, outputs scaled by the float32 weights) plus `shared_experts`, a SwiGLU
    MLP with merged `gate_up_proj` / `down_proj` (`llama.MLP`, this rank's slice of its
    inner size; None: no shared experts), summed over the group once."""

    def __init__(
        self,
        hidden: int,
        moe: MoeConfig,
        inner: int,
        dtype: torch.dtype,
        tp: TpGroup | None = None,
        experts: range | None = None,
        shared_experts: nn.Module | None = None,
    ) -> None:
        super().__init__(hidden, moe, inner, dtype, tp, float32_weights=True, experts=experts)
        self.moe = moe
        self.gate = TopkRouter(hidden, moe, dtype)
        self.shared_experts = shared_experts

    def merge_projections(self) -> None:
        super().merge_projections()
        if self.shared_experts is not None:
            self.shared_experts.merge_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = grouped_route(self.gate(x), self.moe, self.gate.e_score_correction_bias)
        out = self.experts(x, weights, experts)
        shared = self.shared_experts
        if shared is not None:  # its down projection's partial sum joins the routed one's
            out = out + shared.down_proj(silu_and_mul(shared.gate_up_proj(x)))
        return self.tp.all_reduce(out)
