"""A LoRA adapter in PEFT's format, read and checked: `adapter_config.json` (rank `r`,
`lora_alpha`, `target_modules`, `use_rslora`) and `adapter_model.safetensors` (`...<module>.
lora_A.weight` `[r, in]`, `...lora_B.weight` `[out, r]`). The update of a module is
`scaling * B @ A` with scaling `alpha / r` (`alpha / sqrt(r)` with rsLoRA), as PEFT merges
it. Targets may be any subset of the attention and MLP projections; anything PEFT can do
that this server does not apply (DoRA, trained biases, embedding or LM-head adapters,
fan-in/fan-out layouts) is refused naming it, so an adapter never loads half-applied."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from common.json_depth import load_json

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 64
MAX_CONFIG_DEPTH = 32  # adapter_config.json nests 2-3 levels; deeper is not PEFT's format
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoraAdapterError(ValueError):
    """The folder is not an adapter this server can apply (the message says why)."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # (layer, module) -> (A [r, in], B [out, r]) in float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def load_adapter(
    name: str, folder: str | os.PathLike, num_layers: int, max_rank: int = MAX_LORA_RANK
) -> LoraAdapter:
    from safetensors.torch import load_file

    path = Path(folder)
    try:
        config = load_json((path / "adapter_config.json").read_bytes(), MAX_CONFIG_DEPTH,
                           "adapter_config.json")  # fmt: skip
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: no readable adapter_config.json "
                               f"in {path}: {exc}") from exc  # fmt: skip
    _check_config(name, config, max_rank)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    files = [path / "adapter_model.safetensors"]
    if not files[0].is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors")
    tensors = load_file(str(files[0]))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA "
                                   f"A/B weight of {', '.join(TARGETS)}")  # fmt: skip
        layer = int(match.group(1))
        if layer >= num_layers:
            raise LoraAdapterError(f"LoRA adapter {name!r}: layer {layer} but the model has "
                                   f"{num_layers}")  # fmt: skip
        parts.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor.float()
    weights = {}
    for key, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: layer {key[0]} {key[1]} lacks "
                                   f"lora_{'A' if 'A' not in pair else 'B'}")  # fmt: skip
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            shapes = f"A {tuple(a.shape)}, B {tuple(b.shape)}"
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: layer {key[0]} {key[1]} has {shapes} for rank {rank}"
            )
        weights[key] = (a, b)
    if not weights:
        raise LoraAdapterError(f"LoRA adapter {name!r}: no LoRA weights in {files[0]}")
    return LoraAdapter(name, rank, scaling, weights)


def _check_config(name: str, config: dict, max_rank: int) -> None:
    def refuse(what: str) -> None:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {what}")

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or not 1 <= rank <= max_rank:
        refuse(f"rank r={rank!r} must be in 1..{max_rank} (--max-lora-rank)")
    if config.get("use_dora"):
        refuse("DoRA (use_dora) is not supported")
    if config.get("bias", "none") != "none":
        refuse(f"bias={config.get('bias')!r}: trained biases are not supported")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out layouts are not supported")
    if config.get("modules_to_save"):
        refuse(f"modules_to_save {config.get('modules_to_save')} are not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        refuse(f"target_modules as a pattern ({targets!r}) is not supported; list them")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        refuse(f"target_modules {unknown} are not supported (any of {', '.join(TARGETS)})")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            refuse(f"{key} is not supported")
