"""Batched next-token sampling: one vectorised pass per step over float32 logits [B, V].

Order (see tandem.v1.SamplingParams): logit_bias, min_tokens (the stop tokens at -inf),
repetition penalty (prompt and output), presence and frequency penalties (output), then
temperature. Rows with temperature 0 take the argmax of the processed logits; the others
are truncated by top-k, top-p and min-p and drawn by the exponential race over
counter-based noise (`seeded_noise`), keyed by the seed (or a fresh random key) and the
output position (rows with only a temperature, on CPU: one C++ pass per row,
`kernels/cpu/gumbel_race.cpp`). Per-row parameters become tensors once per step; rows
without a setting are untouched, and a step of plain greedy rows stays a bare argmax.
Logprobs come from the raw logits (`logprobs`), for the rows that ask only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.sampling import Logprob, SamplingParams
from kernels import cpu_ops
from services.worker import logits_processors as lp
from services.worker.logprobs import DeviceLogprobs, raw_logprobs, to_host
from services.worker.seeded_noise import gumbel, random_keys, row_streams, split_key

# Truncated rows sort fully (instead of topk) when the largest top_k reaches this share of V.
_FULL_SORT_SHARE = 0.25
# Elements per chunk of the race's noise: its temporaries stay cache-sized on CPU and
# bounded on accelerators.
_RACE_CHUNK_CPU = 1 << 18
_RACE_CHUNK = 1 << 22


@dataclass(frozen=True)
class SamplingRow:
    """One row of a sampling step: the request's parameters and its tokens so far."""

    sampling: SamplingParams
    token_ids: Sequence[int] = ()  # prompt + output so far (what penalties see)
    num_prompt_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far: the output position of the token being sampled."""
        return max(0, len(self.token_ids) - self.num_prompt_tokens)


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[Logprob | None]  # per row; None where the row did not ask


@dataclass(frozen=True)
class DeviceSample:
    """A step's sampling results still on the device (fetched with the step's other results)."""

    token_ids: torch.Tensor  # int64 [B]
    logprob_rows: tuple[int, ...]
    logprobs: DeviceLogprobs | None

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids, *(self.logprobs.tensors() if self.logprobs is not None else [])]

    def from_host(self, values: Sequence[Sequence[float]]) -> SampleResult:
        """`values`: `tensors()` as flat host lists (see `logprobs.to_host`)."""
        tokens = [int(t) for t in values[0]]
        per_row: list[Logprob | None] = [None] * len(tokens)
        if self.logprobs is not None:
            for row, entry in zip(
                self.logprob_rows, self.logprobs.from_host(values[1:]), strict=True
            ):
                per_row[row] = entry
        return SampleResult(tokens, per_row)


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None = None
) -> SampleResult:
    """logits float32 [B, V], one SamplingRow per row -> tokens (and logprobs) on the host."""
    result = sample_on_device(logits, rows, generator)
    return result.from_host(to_host(result.tensors()))


def sample_on_device(
    logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None = None
) -> DeviceSample:
    """`sample` without the transfer: the results stay on the logits' device."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} sampling rows")
    device = logits.device
    processed = process_logits(logits, rows)
    drawn = [i for i, row in enumerate(rows) if not row.sampling.is_greedy]
    if len(drawn) == len(rows):
        tokens = _draw(processed, rows, generator)
    else:
        tokens = processed.argmax(dim=-1)
        if drawn:
            index = to_device(drawn, torch.int64, device)
            tokens[index] = _draw(processed[index], [rows[i] for i in drawn], generator)
    asked = [i for i, row in enumerate(rows) if row.sampling.logprobs is not None]
    logprobs = None
    if asked:
        widths = [rows[i].sampling.logprobs for i in asked]
        if len(asked) == len(rows):
            logprobs = raw_logprobs(logits, tokens, widths)
        else:
            index = to_device(asked, torch.int64, device)
            logprobs = raw_logprobs(logits[index], tokens[index], widths)
    return DeviceSample(tokens, tuple(asked), logprobs)


_NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (of numbers or equal-length tuples) as a tensor on `device`, without
    waiting for the device's queued work."""
    tensor = torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class _Entries:
    """Flat (row, token id) entries of one processor, gathered row by row on the host."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.counts: list[int] = []  # entries per row, for every row so far

    def add(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)
        self.counts.append(len(token_ids))

    def skip(self) -> None:
        self.counts.append(0)

    def __bool__(self) -> bool:
        return bool(self.token_ids)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, token_ids), int64 [N] each, on `device`."""
        counts = to_device(self.counts, torch.int64, device)
        all_rows = torch.arange(len(self.counts), device=device)
        rows = all_rows.repeat_interleave(counts, output_size=len(self.token_ids))
        return rows, to_device(self.token_ids, torch.int64, device)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Bias, min_tokens and penalties; `logits` itself when no row uses any of them."""
    if not any(row.sampling.has_processors for row in rows):
        return logits
    vocab = logits.shape[1]
    bias, stops, seen, outputs = _Entries(), _Entries(), _Entries(), _Entries()
    bias_values: list[float] = []
    for row in rows:
        s = row.sampling
        in_vocab = [(t, v) for t, v in s.logit_bias if 0 <= t < vocab]
        bias.add([t for t, _ in in_vocab])
        bias_values.extend(v for _, v in in_vocab)
        if row.num_output_tokens < s.min_tokens:
            stops.add([t for t in s.stop_token_ids if 0 <= t < vocab])
        else:
            stops.skip()
        if s.repetition_penalty != 1.0:
            seen.add(row.token_ids)  # prompt and output
        else:
            seen.skip()
        if s.presence_penalty != 0.0 or s.frequency_penalty != 0.0:
            outputs.add(row.token_ids[row.num_prompt_tokens :])
        else:
            outputs.skip()
    if not (bias or stops or seen or outputs):
        return logits
    device = logits.device
    out = logits.clone()
    if bias:
        lp.add_logit_bias(out, *bias.tensors(device), to_device(bias_values, out.dtype, device))
    if stops:
        lp.suppress_tokens(out, *stops.tensors(device))
    if seen or outputs:
        penalties = to_device(
            [
                (
                    r.sampling.repetition_penalty,
                    r.sampling.presence_penalty,
                    r.sampling.frequency_penalty,
                )
                for r in rows
            ],
            out.dtype,
            device,
        )
        if seen:
            lp.apply_repetition_penalty(out, *seen.tensors(device), penalties[:, 0])
        if outputs:
            lp.apply_presence_frequency(
                out, *outputs.tensors(device), penalties[:, 1], penalties[:, 2]
            )
    return out


@dataclass(frozen=True)
class _DrawParams:
    """Per-row draw parameters on the device, for R rows with temperature > 0."""

    top_k: torch.Tensor  # int64 [R], 1..V
    top_p: torch.Tensor | None  # float [R]; None: no row uses top-p
    min_p: torch.Tensor | None  # float [R] in [0, 1]; None: no row uses min-p
    streams: torch.Tensor  # int64 [R, 2] noise streams (key, output position)

    def rows(self, index: torch.Tensor) -> _DrawParams:
        return _DrawParams(
            self.top_k[index],
            None if self.top_p is None else self.top_p[index],
            None if self.min_p is None else self.min_p[index],
            self.streams[index],
        )


def _draw(
    logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None
) -> torch.Tensor:
    """Temperature, truncation and the exponential race for rows with temperature > 0."""
    device = logits.device
    vocab = logits.shape[1]
    top_k = [min(r.sampling.top_k, vocab) if r.sampling.top_k > 0 else vocab for r in rows]
    seeds = [r.sampling.seed for r in rows]
    ints = to_device(
        [
            (k, r.num_output_tokens, *split_key(seed or 0), seed is not None)
            for k, r, seed in zip(top_k, rows, seeds, strict=True)
        ],
        torch.int64,
        device,
    )
    floats = to_device(
        [(r.sampling.temperature, r.sampling.top_p, r.sampling.min_p) for r in rows],
        logits.dtype,
        device,
    )
    keys = ints[:, 2:4]
    if any(seed is None for seed in seeds):
        keys = torch.where(ints[:, 4:5].bool(), keys, random_keys(len(rows), device, generator))
    params = _DrawParams(
        top_k=ints[:, 0],
        top_p=floats[:, 1] if any(r.sampling.top_p < 1.0 for r in rows) else None,
        min_p=floats[:, 2].clamp(0.0, 1.0) if any(r.sampling.min_p > 0 for r in rows) else None,
        streams=row_streams(keys, ints[:, 1]),
    )
    temperature = floats[:, 0:1]
    truncated = [k < vocab or r.sampling.top_p < 1.0 for k, r in zip(top_k, rows, strict=True)]
    if all(truncated):
        return _draw_truncated(logits, temperature, params, max(top_k))
    if not any(truncated):
        return _draw_dense(logits, temperature, params)
    tokens = torch.empty(len(rows), dtype=torch.int64, device=device)
    for group, draw in ((True, _draw_truncated), (False, _draw_dense)):
        members = [i for i, t in enumerate(truncated) if t == group]
        index = to_device(members, torch.int64, device)
        width = max(top_k[i] for i in members)
        tokens[index] = draw(logits[index], temperature[index], params.rows(index), width)
    return tokens


def _draw_truncated(
    logits: torch.Tensor, temperature: torch.Tensor, params: _DrawParams, width: int
) -> torch.Tensor:
    """Rows with top-k or top-p: the candidates are each row's `width` best tokens, sorted
    (temperature > 0 keeps the order, so it divides the candidates only)."""
    if width >= _FULL_SORT_SHARE * logits.shape[1]:
        values, ids = logits.sort(dim=-1, descending=True)
        values, ids = values[:, :width], ids[:, :width]
    else:
        values, ids = logits.topk(width, dim=-1)
    values = lp.truncate_sorted(values / temperature, params.top_k, params.top_p, params.min_p)
    pick = _race(values, ids, params.streams)
    return ids.gather(1, pick.unsqueeze(1)).squeeze(1)


def _draw_dense(
    logits: torch.Tensor, temperature: torch.Tensor, params: _DrawParams, width: int = 0
) -> torch.Tensor:
    """Rows without top-k or top-p: every token is a candidate (min-p may drop some)."""
    if params.min_p is None and _one_pass_race(logits):
        return torch.ops.tandem_cpu.gumbel_race(logits, temperature.reshape(-1), params.streams)
    values = logits / temperature
    if params.min_p is not None:
        values = lp.apply_min_p(values, params.min_p)
    return _race(values, None, params.streams)


def _one_pass_race(logits: torch.Tensor) -> bool:
    """Whether the dense race runs as one C++ pass per row (`kernels/cpu/gumbel_race.cpp`:
    float32 logits on CPU, the kernels built) instead of the torch ops below."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.available()


def _race(values: torch.Tensor, ids: torch.Tensor | None, streams: torch.Tensor) -> torch.Tensor:
    """Column of argmax(values + gumbel noise of the row's token ids) per row; ids None means
    the columns are the whole vocabulary. Rows go in chunks (same result, less memory)."""
    rows, cols = values.shape
    chunk = _RACE_CHUNK_CPU if values.device.type == "cpu" else _RACE_CHUNK
    step = max(1, chunk // cols)
    vocab = torch.arange(cols, device=values.device).unsqueeze(0) if ids is None else None
    picks = []
    for start in range(0, rows, step):
        part = slice(start, start + step)
        noise = gumbel(streams[part], vocab if ids is None else ids[part])
        picks.append(noise.add_(values[part]).argmax(dim=-1))
    return picks[0] if len(picks) == 1 else torch.cat(picks)
