"""The decode side's speculative decoding settings: `SpeculativeConfig` (its fields, defaults
and limits) and `parse_speculative_config`, which reads the `--speculative-config` JSON
(also `TANDEM_SPECULATIVE_CONFIG`).

Field names and meanings are vLLM's, so a user's vLLM config works unchanged:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}

As in vLLM, an absent `method` is inferred: `"model": "ngram"` means n-gram, any other model
means a draft model. `num_draft_layers` is Tandem's own: the draft runs only the first N
decoder layers of its checkpoint (then the final norm and LM head), which makes the target
checkpoint usable as its own cheap, self-speculative draft. Whether `model` exists is checked
by the worker that loads it, not here. Pure Python: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_PROMPT_LOOKUP = 32
# vLLM's n-gram window when neither prompt_lookup_min nor prompt_lookup_max is given.
DEFAULT_PROMPT_LOOKUP = 5
FLAG = "--speculative-config"

Method = Literal["ngram", "draft_model"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value: object, low: int, high: int | None = None) -> None:
    limit = f"in [{low}, {high}]" if high is not None else f">= {low}"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {limit}, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Resolved speculative decoding settings; construction checks every limit below.

    `prompt_lookup_min`/`prompt_lookup_max` are resolved for n-gram (either one fills in the
    other; neither gives vLLM's 5 and 5) and stay None for a draft model."""

    method: Method
    num_speculative_tokens: int  # k: tokens proposed per step, 1..16
    prompt_lookup_min: int | None = None  # ngram: shortest suffix n-gram matched
    prompt_lookup_max: int | None = None  # ngram: longest suffix n-gram matched (<= 32)
    model: str | None = None  # draft_model: its checkpoint folder (required); ngram: none
    # Speculation is off for a step whose batch has at least this many running requests.
    disable_by_batch_size: int | None = None
    # draft_model only (Tandem's): run only the draft checkpoint's first N decoder layers.
    num_draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 2)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value is not None:
                _int_in(name, value, 1, MAX_PROMPT_LOOKUP)
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        for name in ("model", "num_draft_layers"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is for method draft_model, not ngram")

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(
                f"model (the draft checkpoint's folder) must be a non-empty string for "
                f"method draft_model, got {self.model!r}"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is for method ngram, not draft_model")
        if self.num_draft_layers is not None:
            _int_in("num_draft_layers", self.num_draft_layers, 1)

    def to_dict(self) -> dict[str, Any]:
        """The set fields (None left out); `SpeculativeConfig(**to_dict())` is equal."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    def to_json(self) -> str:
        """One-line JSON that `parse_speculative_config` reads back to an equal config."""
        return json.dumps(self.to_dict(), separators=(",", ":"))


_FIELDS = tuple(f.name for f in fields(SpeculativeConfig))


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """`--speculative-config`'s JSON object -> a config; None, "" or "null" -> None (off).

    Every error is a ValueError whose message is one line starting with
    "--speculative-config: ", naming the field at fault."""
    try:
        return _parse(text)
    except ValueError as e:
        message = " ".join(str(e).split())
        raise ValueError(f"{FLAG}: {message}") from None


def _parse(text: str | None) -> SpeculativeConfig | None:
    if text is None or not text.strip() or text.strip() == "null":
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"must be a JSON object, got {type(raw).__name__}: {text.strip()}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; known keys: {', '.join(_FIELDS)}")
    values = dict(raw)
    if "method" not in values:  # vLLM's inference from `model`
        model = values.get("model")
        if model is None:
            raise ValueError(f"method is required (one of {', '.join(METHODS)})")
        if model == "ngram":
            values["method"] = "ngram"
            del values["model"]
        else:
            values["method"] = "draft_model"
    if not isinstance(values["method"], str):
        raise ValueError(f"method must be a string, one of {', '.join(METHODS)}")
    if "num_speculative_tokens" not in values:
        raise ValueError(
            f"num_speculative_tokens is required (an integer in [1, {MAX_SPECULATIVE_TOKENS}])"
        )
    if "model" in values and values["model"] is not None and not isinstance(values["model"], str):
        raise ValueError(f"model must be a string (a folder path), got {values['model']!r}")
    return SpeculativeConfig(**values)
