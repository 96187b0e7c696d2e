"""Batched next-token sampling: one vectorised pass over the step's logits.

Rows with temperature 0 take the argmax (greedy, exactly HF's `do_sample=False`); the rest
are tempered, truncated by top-k and top-p over one descending sort, and drawn with
`torch.multinomial`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.batch import Sampling


def sample(
    logits: torch.Tensor, params: Sequence[Sampling], generator: torch.Generator | None = None
) -> list[int]:
    """logits float32 [B, V], one Sampling per row -> B token ids."""
    if logits.shape[0] != len(params):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} sampling params")
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        chosen = [params[i] for i in random_rows]
        tokens[rows] = _sample_random(logits[rows], chosen, generator)
    return tokens.tolist()


def _sample_random(
    logits: torch.Tensor, params: Sequence[Sampling], generator: torch.Generator | None
) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature.unsqueeze(1)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first stays).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    picks = torch.multinomial(sorted_logits.softmax(dim=-1), 1, generator=generator)
    return sorted_ids.gather(1, picks).squeeze(1)
