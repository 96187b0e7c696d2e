"""HF `generate` on the benchmark's prompts: static batching baseline (left-padded batches
in arrival order, greedy, fp32), counting only each request's useful tokens."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from bench.workloads import BenchRequest


def _eos_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _row_tokens(row: Sequence[int], eos: set[int]) -> int:
    """Generated tokens of one batch row: up to and including its first EOS."""
    for position, token in enumerate(row):
        if token in eos:
            return position + 1
    return len(row)


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@torch.inference_mode()
def _hf_generate(model, prompts: Sequence[Sequence[int]], max_new: int, pad_id: int):
    ids, mask = _left_padded(prompts, pad_id)
    out = model.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=pad_id
    )
    return out[:, ids.shape[1] :].tolist()


def hf_baseline(
    model_dir: str,
    requests: Sequence[BenchRequest],
    produced: Sequence[int],
    batch_size: int,
    pad_id: int,
) -> dict:
    """HF `generate` over the requests as static batches; `produced[i]` caps request i's
    useful tokens at what Tandem produced for it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = _eos_ids(model.generation_config)
    _hf_generate(model, [requests[0].prompt_ids[:16]], 4, pad_id)  # warm-up
    useful = generated = prompt = 0
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        rows = _hf_generate(
            model, [r.prompt_ids for r in batch], max(r.max_tokens for r in batch), pad_id
        )
        for request, row in zip(batch, rows, strict=True):
            own = _row_tokens(row, eos)
            useful += min(request.max_tokens, produced[request.index], own)
            generated += own
            prompt += len(request.prompt_ids)
    wall = time.perf_counter() - start
    return {
        "batch_size": batch_size,
        "batches": math.ceil(len(requests) / batch_size),
        "wall_s": round(wall, 3),
        "prompt_tokens": prompt,
        "output_tokens": useful,
        "generated_tokens": generated,
        "output_tokens_per_s": round(useful / wall, 3),
        "total_tokens_per_s": round((prompt + useful) / wall, 3),
        "requests_per_s": round(len(requests) / wall, 3),
    }
