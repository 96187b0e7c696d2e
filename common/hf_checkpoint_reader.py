"""Reading a Hugging Face checkpoint folder: its safetensors weights (one file or shards
listed in `model.safetensors.index.json`) and its tokenizer.

`config.json` is read by `common.model_config`; building a model from these tensors is the
worker's job (`services.worker.models.weight_loader`); building a random-weight checkpoint
for tests and `make up` is `devtools.checkpoint_builder`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: str | os.PathLike) -> dict[Path, list[str] | None]:
    """Map each safetensors file to the tensor names to read from it (None = all)."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
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
            files.setdefault(shard_path, []).append(name)
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return {single: None}
    raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in model folder {str(folder)!r}")


def iter_tensors(
    folder: str | os.PathLike, keep: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every weight whose name `keep` accepts, shard by shard;
    tensors that are not kept are never read."""
    from safetensors import safe_open  # torch-backed; only workers read weights

    for shard, names in weight_files(folder).items():
        with safe_open(str(shard), framework="pt", device="cpu") as handle:
            for name in names if names is not None else handle.keys():
                if keep(name):
                    yield name, handle.get_tensor(name)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: str | os.PathLike):
    """The checkpoint's tokenizer (`tokenizer.json` / `tokenizer_config.json`), offline."""
    path = Path(folder)
    if not any((path / name).is_file() for name in ("config.json", *TOKENIZER_FILES)):
        raise ValueError(
            f"{folder} is not a model folder: no config.json and no tokenizer "
            f"({', '.join(TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from exc
