"""The worker's proposer for its `--speculative-config` (None: no speculative decoding)."""

from __future__ import annotations

from common.speculative_config import SpeculativeConfig
from services.worker.spec_decode.ngram_proposer import NgramProposer
from services.worker.spec_decode.verify import Proposer


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"--speculative-config: method {config.method} is not built yet")
