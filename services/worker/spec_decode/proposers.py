"""The worker's proposer for its `--speculative-config` (None: no speculative decoding)."""

from __future__ import annotations

import torch

from common.speculative_config import SpeculativeConfig
from services.worker.kv_cache import KvCache
from services.worker.spec_decode.draft_loader import DraftModel
from services.worker.spec_decode.draft_model_proposer import DraftModelProposer
from services.worker.spec_decode.ngram_proposer import NgramProposer
from services.worker.spec_decode.verify import BatchProposer, Proposer


def make_proposer(
    config: SpeculativeConfig | None,
    draft: DraftModel | None = None,
    draft_cache: KvCache | None = None,
    device: torch.device | None = None,
) -> Proposer | BatchProposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model" and draft is not None and draft_cache is not None:
        return DraftModelProposer(draft.model, draft_cache, device or draft_cache.device)
    raise ValueError(f"--speculative-config: method {config.method} has no loaded draft")
