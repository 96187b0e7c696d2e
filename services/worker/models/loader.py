"""Loads a Hugging Face safetensors checkpoint folder into `LlamaForCausalLM`.

Reads the config through `ModelConfig.from_folder`, builds the module skeleton on the meta
device (no wasted random init), then reads `model.safetensors` or the shards listed in
`model.safetensors.index.json` and assigns the tensors, cast to the requested dtype and
device. Loading is strict: a missing or unexpected weight is a `ValueError` naming a few of
them (rotary `inv_freq` buffers, which some checkpoints carry, are ignored).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from common.model_config import ModelConfig
from services.worker.models.llama import LlamaForCausalLM

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    folder: str | os.PathLike, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for `folder` and load its weights; returns (model in eval mode, config)."""
    path = Path(folder)
    config = ModelConfig.from_folder(path)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype=dtype)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    tied_head = "lm_head.weight" if config.tie_word_embeddings else None

    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for shard, names in _weight_files(path).items():
        with safe_open(str(shard), framework="pt", device="cpu") as handle:
            for name in names if names is not None else handle.keys():
                if name == tied_head or name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != expected[name]:
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)}, "
                        f"model expects {expected[name]}"
                    )
                state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state) - {tied_head})
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(path)!r} does not match the {config.architecture} model: "
            f"missing {len(missing)} weights {missing[:5]}, "
            f"unexpected {len(unexpected)} weights {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, config


def _weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """Map each safetensors file to the tensor names to read from it (None = all)."""
    index_path = folder / _INDEX_FILE
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        files: dict[Path, list[str] | None] = {}
        for name, shard in weight_map.items():
            shard_path = folder / shard
            if not shard_path.is_file():
                raise ValueError(f"shard {shard!r} listed in {index_path} does not exist")
            names = files.setdefault(shard_path, [])
            if names is not None:
                names.append(name)
        return files
    single = folder / _SINGLE_FILE
    if single.is_file():
        return {single: None}
    raise ValueError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in model folder {str(folder)!r}")
