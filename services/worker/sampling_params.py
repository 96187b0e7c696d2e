"""What the worker knows about how to sample one request (resolved, validated upstream)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; prompt and output tokens
    presence_penalty: float = 0.0  # output tokens
    frequency_penalty: float = 0.0  # output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None  # None = the worker's generator
    min_tokens: int = 0  # stop_token_ids are suppressed until this many outputs exist
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # top alternatives per sampled token; None = no logprobs
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None = none

    @property
    def is_greedy(self) -> bool:
        """Argmax of the processed logits (temperature 0; a negative one is treated alike)."""
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def has_processors(self) -> bool:
        """Whether anything changes the logits before temperature (bias, min_tokens, penalties)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.has_penalties
