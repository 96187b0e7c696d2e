"""How to sample a request and what a sampled token scored: the one `SamplingParams` (its
defaults and limits) and the one `Logprob`, used alike by gateway, scheduler and worker.

The defaults are each setting's "off" value (temperature 0 = greedy), which is also what an
unset field of the internal `SamplingParams` message means. The public API's temperature
when a client leaves it unset is `API_DEFAULT_TEMPERATURE`, which the gateway applies.
Protobuf conversions are in `common/sampling_pb.py`. Pure Python: no protobuf, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SAMPLES = 16  # n: samples of one request
MAX_LOGPROBS = 20  # alternatives per token (logprobs, prompt_logprobs) a client may ask
MAX_BEAM_WIDTH = 8  # beams of a beam search request
# Alternatives per sampled token the scheduler may ask a worker for: beam search needs
# (1 + EOS ids) * beam_width per beam (HF's candidate count), more than clients may ask.
MAX_INTERNAL_LOGPROBS = 64
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties
MAX_LOGIT_BIAS = 300  # entries
MAX_ABS_LOGIT_BIAS = 100.0
MAX_SEED = 2**64 - 1  # a uint64 on the wire
API_DEFAULT_TEMPERATURE = 1.0  # an unset public temperature (OpenAI's and vLLM's default)


def _finite_in(name: str, value: float, low: float, high: float) -> None:
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value}")


def _optional_count(name: str, value: int | None, limit: int = MAX_LOGPROBS) -> None:
    if value is not None and not 0 <= value <= limit:
        raise ValueError(f"{name} must be in [0, {limit}], got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """Resolved sampling settings of one request (one sample of it, in the scheduler and the
    worker). They apply in the order of docs/api.md: logit_bias, min_tokens, penalties,
    temperature, then top-k, top-p and min-p. Construction checks every limit below."""

    temperature: float = 0.0  # 0 = greedy (argmax of the processed logits)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; prompt and output tokens
    presence_penalty: float = 0.0  # output tokens
    frequency_penalty: float = 0.0  # output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by token id
    seed: int | None = None  # None = the worker's own generator
    min_tokens: int = 0  # stop_token_ids are held back until this many outputs exist
    # What min_tokens holds back: the request's stop tokens, filled in by the scheduler for
    # the worker (the scheduler itself keeps them in `Request.stop_token_ids`).
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # alternatives per sampled token; None = no logprobs
    prompt_logprobs: int | None = None  # alternatives per prompt token; None = none

    def __post_init__(self) -> None:
        _finite_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        _finite_in("min_p", self.min_p, 0.0, 1.0)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                f"got {self.repetition_penalty}"
            )
        _finite_in("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _finite_in("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias key {token} is not a token id (must be >= 0)")
            _finite_in(f"logit_bias[{token}]", bias, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        _optional_count("logprobs", self.logprobs, MAX_INTERNAL_LOGPROBS)
        _optional_count("prompt_logprobs", self.prompt_logprobs)

    @property
    def is_greedy(self) -> bool:
        """Argmax of the processed logits: no draw."""
        return self.temperature == 0.0

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


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model's raw distribution (log_softmax of the
    unprocessed logits), with the top alternatives as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
