"""When a waiting request of a pool may join its running batch, beyond tokens and blocks:
its LoRA adapter must fit the pool's `max_loras`, and sample i > 0 of an n > 1 request
waits for sample 0's prompt blocks. Pure Python."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.scheduler.request import Request


def lora_fits(request: Request, running: Sequence[Request], max_loras: int) -> bool:
    """Running it keeps the running requests within `max_loras` distinct adapters."""
    if not max_loras or not request.lora_name:
        return True
    active = {r.lora_name for r in running if r.lora_name}
    return request.lora_name in active or len(active) < max_loras


def awaits_prompt(request: Request, queued: Iterable[Request], block_size: int) -> bool:
    """True for sample i > 0 of n while sample 0 (`prompt_of`), among `queued` (the
    pool's queues), has not yet planned every full prompt block: waiting lets it reuse
    them all instead of computing them again (prefix caching on)."""
    if not request.prompt_of:
        return False
    first = next((r for r in queued if r.request_id == request.prompt_of), None)
    if first is None:
        return False
    shareable = (len(request.prompt_token_ids) - 1) // block_size
    return first.num_computed_tokens < shareable * block_size
