"""Mixture-of-experts checkpoint tensors under the names and layouts `moe.SparseMoeBlock`
loads: every layer's experts stacked into `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I], its router as `mlp.gate.weight`.

Checkpoints come in two layouts, both read here:
- one tensor per expert, which `transformers`' `save_pretrained` writes by default (its
  "original format") and the published checkpoints use: Mixtral's
  `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate/up/down) with its router at
  `block_sparse_moe.gate.weight`, Qwen3-MoE's `mlp.experts.{e}.gate_proj/up_proj/
  down_proj.weight`. A layer's tensors are stacked as soon as all its experts' parts have
  been read (they may lie in different shards); a part missing for some expert is a
  `ValueError` naming the layer and the experts;
- transformers v5's own fused layout (`save_pretrained(save_original_format=False)`):
  `mlp.experts.gate_up_proj` / `down_proj`, already stacked; Mixtral's only renamed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_PER_EXPERT = re.compile(
    r"^(?P<layer>model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}
_ROLE.update({"w2": "down", "down_proj": "down"})


def stacked_experts(
    tensors: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` (checkpoint name, tensor) with every layer's per-expert tensors stacked into
    the fused ones and Mixtral's `block_sparse_moe.` renamed `mlp.`; other tensors pass."""
    pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    done: set[tuple[str, str]] = set()
    for name, tensor in tensors:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
            continue
        layer, expert, role = match["layer"], int(match["expert"]), _ROLE[match["part"]]
        if expert >= num_experts:
            raise ValueError(f"checkpoint weight {name}: the model has {num_experts} experts")
        pending.setdefault((layer, role), {})[expert] = tensor
        if role == "down" and len(pending[(layer, "down")]) == num_experts:
            done.add((layer, "down"))
            yield f"{layer}.mlp.experts.down_proj", _stack(pending.pop((layer, "down")))
        gate, up = pending.get((layer, "gate"), {}), pending.get((layer, "up"), {})
        if len(gate) == len(up) == num_experts:
            del pending[(layer, "gate")], pending[(layer, "up")]
            done.update({(layer, "gate"), (layer, "up")})
            yield f"{layer}.mlp.experts.gate_up_proj", torch.cat([_stack(gate), _stack(up)], 1)
    if pending:
        _raise_incomplete(pending, done, num_experts)


def _raise_incomplete(
    pending: dict[tuple[str, str], dict[int, torch.Tensor]],
    done: set[tuple[str, str]],
    num_experts: int,
) -> None:
    layer = min(layer for layer, _ in pending)
    for role in ("gate", "up", "down"):
        absent = sorted(set(range(num_experts)) - set(pending.get((layer, role), {})))
        if (layer, role) not in done and absent:
            raise ValueError(
                f"checkpoint lacks the {role} weights of {len(absent)} of {num_experts} "
                f"experts in {layer} (experts {absent[:8]})"
            )


def _stack(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.stack([parts[expert] for expert in sorted(parts)])
