"""Raw log-probabilities for sampled and prompt tokens.

A token's logprob is taken from `log_softmax` of the unprocessed logits (the model's raw
distribution, vLLM's default), with the top alternatives sorted by logprob, descending.
They are computed on the device; `to_host` brings a step's result tensors back in one
transfer, and `DeviceLogprobs.from_host` turns them into frozen host records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.sampling import Logprob


@dataclass(frozen=True)
class DeviceLogprobs:
    """R rows on the device: the scored token, its logprob, and `widths[r]` alternatives."""

    token_ids: torch.Tensor  # int64 [R]
    logprobs: torch.Tensor  # float32 [R]
    top_ids: torch.Tensor  # int64 [R, W]
    top_logprobs: torch.Tensor  # float32 [R, W]
    widths: tuple[int, ...]  # alternatives kept per row, each <= W

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids, self.logprobs, self.top_ids, self.top_logprobs]

    def from_host(self, values: Sequence[Sequence[float]]) -> list[Logprob]:
        """`values`: this object's `tensors()` as flat host lists (see `to_host`)."""
        token_ids, logprobs, top_ids, top_logprobs = values
        width = self.top_ids.shape[1]
        rows = []
        for r, keep in enumerate(self.widths):
            at = r * width
            top = tuple((int(top_ids[at + j]), float(top_logprobs[at + j])) for j in range(keep))
            rows.append(Logprob(int(token_ids[r]), float(logprobs[r]), top))
        return rows


def raw_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    widths: Sequence[int],
    width: int | None = None,
) -> DeviceLogprobs:
    """logits float32 [R, V] (unprocessed), the token scored per row int64 [R], the number of
    alternatives per row (clamped to [0, V]); `width` fixes the top-k width (for
    concatenating slices), default max(widths)."""
    vocab = logits.shape[1]
    if width is None:
        width = max(widths, default=0)
    width = max(0, min(width, vocab))
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(width, dim=-1)
    kept = tuple(max(0, min(k, width)) for k in widths)
    return DeviceLogprobs(token_ids, chosen, top_ids, top_logprobs, kept)


def concat(parts: Sequence[DeviceLogprobs]) -> DeviceLogprobs:
    """Rows of several `DeviceLogprobs` of the same width, in order."""
    if len(parts) == 1:
        return parts[0]
    return DeviceLogprobs(
        torch.cat([p.token_ids for p in parts]),
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.top_ids for p in parts]),
        torch.cat([p.top_logprobs for p in parts]),
        tuple(k for p in parts for k in p.widths),
    )


def prompt_entry_span(begin: int, num_new: int, num_prompt_tokens: int) -> tuple[int, int]:
    """(start, count) of the prompt entries a chunk computing positions [begin, begin + num_new)
    yields: positions start .. start + count - 1 with start = begin + 1, never past the
    prompt's last position. Position p is scored by the hidden state at position p - 1."""
    last = min(begin + num_new, num_prompt_tokens - 1)
    return begin + 1, max(0, last - begin)


def to_host(tensors: Sequence[torch.Tensor]) -> list[list]:
    """Each tensor as a flat host list, in one device-to-host transfer (several tensors go
    through float64, which holds token ids below 2**53 and float32 values exactly)."""
    if not tensors:
        return []
    if len(tensors) == 1:
        return [tensors[0].reshape(-1).tolist()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()])
        at += t.numel()
    return out
