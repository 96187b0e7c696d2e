"""gpt-oss checkpoint tensors under the names and layouts `gpt_oss.GptOssForCausalLM` loads.

transformers stores a layer's experts as `mlp.experts.gate_up_proj` `[E, H, 2I]` (x @ W,
the gate and up columns interleaved: gate j is column 2j, up j column 2j + 1) with
`gate_up_proj_bias` `[E, 2I]` (interleaved alike), and `down_proj` `[E, I, H]`. Tandem's
experts (`moe.Experts`) hold `[E, 2I, H]` with every gate row before every up row, and
`[E, H, I]`: the weights are transposed and the interleaved rows (and bias entries)
regrouped, gate then up, so the tensor-parallel slicing and the products are those of the
other MoE families. The published checkpoints store the experts in MXFP4 instead
(`quantization_config.quant_method` "mxfp4"): `gate_up_proj_blocks` / `_scales` hold the
`[E, 2I, H]` matrix (rows interleaved) and `down_proj_blocks` / `_scales` the `[E, H, I]`
one, dequantized here (`mxfp4.dequantize_mxfp4`) as soon as both parts of one are read (they
may lie in different shards); a part whose partner never comes is a `ValueError` naming it.
The router (`mlp.router`), attention sinks and everything else pass unchanged.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from services.worker.models.mxfp4 import dequantize_mxfp4

MXFP4 = "mxfp4"
_EXPERTS = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts\.)(?P<proj>gate_up_proj|down_proj)"
    r"(?P<part>_blocks|_scales|_bias|)$"
)


def is_mxfp4_checkpoint(folder: str | os.PathLike) -> bool:
    """Whether the checkpoint's `quantization_config` names MXFP4 (gpt-oss's experts)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    return isinstance(quant, dict) and quant.get("quant_method") == MXFP4


def gpt_oss_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` (checkpoint name, tensor) with the experts in Tandem's layout (module
    docstring); MXFP4 experts dequantized to `dtype`."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _EXPERTS.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, proj, part = match["prefix"], match["proj"], match["part"]
        if part == "":  # transformers' own layout, unquantized
            weight = tensor.transpose(1, 2)
            yield prefix + proj, _regrouped(proj, weight).contiguous()
        elif part == "_bias":
            yield name, _regrouped(proj, tensor) if proj == "gate_up_proj" else tensor
        else:
            parts = pending.setdefault((prefix, proj), {})
            parts[part] = tensor
            if len(parts) == 2:
                del pending[(prefix, proj)]
                weight = dequantize_mxfp4(parts["_blocks"], parts["_scales"], dtype)
                yield prefix + proj, _regrouped(proj, weight).contiguous()
    if pending:
        (prefix, proj), parts = min(pending.items())
        missing = "_scales" if "_blocks" in parts else "_blocks"
        raise ValueError(f"checkpoint has {prefix}{proj}{next(iter(parts))} without its {missing}")


def _regrouped(proj: str, tensor: torch.Tensor) -> torch.Tensor:
    """gate_up's interleaved rows (dimension 1 of `[E, 2I, ...]`) as gate rows, up rows."""
    if proj != "gate_up_proj":
        return tensor
    return torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
