"""Loads the draft model a `draft_model` speculative config names (its first
`num_draft_layers` layers when set) and checks it can draft for the target: the same
vocabulary, and positions up to the target's `max_model_len`. Its KV pool is allocated by
startup beside the target's (same blocks), so this module also gives the bytes a block of
the draft pool takes. Errors are one line starting with "--speculative-config: "."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.model_config import ModelConfig
from common.rope_config import max_context_length
from common.speculative_config import FLAG, SpeculativeConfig
from services.worker.kv_cache import KvCache
from services.worker.models.attention_backend import AttentionBackend
from services.worker.models.weight_loader import load_model


@dataclass
class DraftModel:
    model: torch.nn.Module
    config: ModelConfig
    dtype: torch.dtype

    def geometry(self, block_size: int) -> dict:
        """KvCache geometry of the draft pool (its blocks are the target pool's)."""
        return dict(
            block_size=block_size,
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
        )

    def block_bytes(self, block_size: int) -> int:
        return KvCache.bytes_per_block(**self.geometry(block_size))


def load_draft(
    spec: SpeculativeConfig | None,
    target: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionBackend,
) -> DraftModel | None:
    """The draft for a `draft_model` config (None for none or n-gram)."""
    if spec is None or spec.method != "draft_model":
        return None
    folder = Path(spec.model)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{FLAG}: model {spec.model!r} is not a checkpoint folder (no config.json)"
        )
    try:
        layers = ModelConfig.from_folder(folder).num_hidden_layers
        if spec.num_draft_layers is not None and spec.num_draft_layers > layers:
            raise ValueError(
                f"num_draft_layers {spec.num_draft_layers} is more than the draft "
                f"checkpoint's {layers} layers"
            )
        model, config = load_model(
            folder, dtype=dtype, device=device, attention=attention,
            num_layers=spec.num_draft_layers,
        )  # fmt: skip
    except (ValueError, OSError) as e:
        raise ValueError(f"{FLAG}: draft model {spec.model!r}: {' '.join(str(e).split())}") from e
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"{FLAG}: the draft model's vocab_size {config.vocab_size} differs from the "
            f"target's {target.vocab_size} (a draft must use the target's tokenizer)"
        )
    if max_context_length(config) < max_model_len:
        raise ValueError(
            f"{FLAG}: the draft model's context length (max_position_embeddings, scaled "
            f"by dynamic RoPE) {max_context_length(config)} is below the target's max_model_len "
            f"{max_model_len} (lower --max-model-len)"
        )
    return DraftModel(model, config, dtype)
