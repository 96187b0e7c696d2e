"""Request workloads of the serving benchmark (`bench/serve.py`): prompts, output lengths and
arrival times, all pure and deterministic for a given seed.

Prompts are lists of token ids drawn uniformly from the model's vocabulary without its
special tokens (BOS, EOS, pad), so no prompt ends early or gets a second BOS, and the server
and the HF baseline see exactly the same ids. Two workloads:

- `mixed`: independent requests. Prompt lengths follow a log-normal distribution (median
  `prompt_len_median`, shape `prompt_len_sigma`) truncated to `prompt_len_range` by
  redrawing; output lengths (`max_tokens`) are uniform over `output_len_range`. Defaults
  (median 128, sigma 0.8, 16-512 prompt tokens, 16-256 output tokens) fit a 2048-token
  context and give a long tail of long prompts next to many short ones.
- `shared-prefix`: `num_groups` groups, each with its own `prefix_len`-token prefix; every
  request is its group's prefix + a unique suffix (length uniform over `suffix_len_range`)
  with a short output (uniform over `output_len_range`). Groups are interleaved round-robin
  in arrival order (request i belongs to group i % num_groups), so the first request of
  each group computes the prefix and later ones can reuse it from the prefix cache.

`arrival_offsets` turns a request rate into Poisson arrival times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

WORKLOADS = ("mixed", "shared-prefix")
MAX_REDRAWS = 10_000


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, in arrival order."""

    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    group: int | None = None  # shared-prefix group, None for independent requests
    lora_name: str = ""  # the LoRA adapter it names ("" = the base model)


@dataclass(frozen=True)
class MixedParams:
    num_requests: int = 200
    prompt_len_median: float = 128.0
    prompt_len_sigma: float = 0.8
    prompt_len_range: tuple[int, int] = (16, 512)
    output_len_range: tuple[int, int] = (16, 256)


@dataclass(frozen=True)
class SharedPrefixParams:
    num_requests: int = 64
    num_groups: int = 8
    prefix_len: int = 512
    suffix_len_range: tuple[int, int] = (16, 64)
    output_len_range: tuple[int, int] = (16, 32)


class TokenizerLike(Protocol):
    all_special_ids: list[int]

    def __len__(self) -> int: ...


def usable_token_ids(tokenizer: TokenizerLike, vocab_size: int | None = None) -> list[int]:
    """Ids a prompt may use: the tokenizer's, minus special tokens, below `vocab_size`."""
    limit = len(tokenizer) if vocab_size is None else min(len(tokenizer), vocab_size)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(limit) if i not in special]
    if not ids:
        raise ValueError("the tokenizer has no non-special token ids")
    return ids


def _check_range(name: str, bounds: tuple[int, int], minimum: int = 1) -> None:
    low, high = bounds
    if not minimum <= low <= high:
        raise ValueError(f"{name} must satisfy {minimum} <= min <= max, got {low}..{high}")


def _random_ids(rng: random.Random, vocab: Sequence[int], length: int) -> tuple[int, ...]:
    return tuple(rng.choices(vocab, k=length))


def truncated_lognormal(
    rng: random.Random, median: float, sigma: float, bounds: tuple[int, int]
) -> int:
    """A log-normal integer in `bounds`, redrawn (not clipped) when it falls outside."""
    low, high = bounds
    if sigma <= 0:
        return min(max(round(median), low), high)
    for _ in range(MAX_REDRAWS):
        value = round(rng.lognormvariate(math.log(median), sigma))
        if low <= value <= high:
            return value
    raise ValueError(f"log-normal(median={median}, sigma={sigma}) rarely falls in {low}..{high}")


def mixed(vocab: Sequence[int], params: MixedParams, seed: int) -> list[BenchRequest]:
    """Independent requests with log-normal prompt lengths and uniform output lengths."""
    _check_range("prompt_len_range", params.prompt_len_range)
    _check_range("output_len_range", params.output_len_range)
    if params.prompt_len_median <= 0:
        raise ValueError(f"prompt_len_median must be > 0, got {params.prompt_len_median}")
    rng = random.Random(f"mixed:{seed}")
    requests = []
    for index in range(params.num_requests):
        length = truncated_lognormal(
            rng, params.prompt_len_median, params.prompt_len_sigma, params.prompt_len_range
        )
        prompt = _random_ids(rng, vocab, length)
        requests.append(BenchRequest(index, prompt, rng.randint(*params.output_len_range)))
    return requests


def shared_prefix(
    vocab: Sequence[int], params: SharedPrefixParams, seed: int
) -> list[BenchRequest]:
    """Groups sharing a long prefix each, unique suffixes, groups interleaved round-robin."""
    _check_range("suffix_len_range", params.suffix_len_range)
    _check_range("output_len_range", params.output_len_range)
    if params.num_groups < 1 or params.prefix_len < 1:
        raise ValueError("num_groups and prefix_len must be >= 1")
    rng = random.Random(f"shared-prefix:{seed}")
    prefixes = [_random_ids(rng, vocab, params.prefix_len) for _ in range(params.num_groups)]
    requests = []
    for index in range(params.num_requests):
        group = index % params.num_groups
        suffix = _random_ids(rng, vocab, rng.randint(*params.suffix_len_range))
        max_tokens = rng.randint(*params.output_len_range)
        requests.append(BenchRequest(index, prefixes[group] + suffix, max_tokens, group))
    return requests


def build_workload(
    name: str, vocab: Sequence[int], params: MixedParams | SharedPrefixParams, seed: int
) -> list[BenchRequest]:
    if name == "mixed" and isinstance(params, MixedParams):
        return mixed(vocab, params, seed)
    if name == "shared-prefix" and isinstance(params, SharedPrefixParams):
        return shared_prefix(vocab, params, seed)
    raise ValueError(f"unknown workload {name!r} or wrong parameters; choose from {WORKLOADS}")


def check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    """Raise if some request's prompt + max_tokens exceeds the model's context."""
    for request in requests:
        need = len(request.prompt_ids) + request.max_tokens
        if need > max_model_len:
            raise ValueError(
                f"request {request.index}: {len(request.prompt_ids)} prompt + "
                f"{request.max_tokens} output tokens exceed the context of {max_model_len}; "
                "use shorter prompt/output lengths"
            )


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of `rate`
    requests/s (exponential gaps), the first request at 0; `inf` sends everything at 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals:{seed}")
    offsets, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def length_summary(values: Sequence[int]) -> dict[str, float]:
    """min / mean / max of a list of lengths, for the report."""
    if not values:
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values)}
