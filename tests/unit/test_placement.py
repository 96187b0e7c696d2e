"""Placement: prefix-cache overlap against load for prefill, least transfer for decode."""

from services.scheduler.placement import (
    DecodeCandidate,
    PrefillCandidate,
    choose_decode,
    choose_prefill,
)


def test_prefill_goes_where_the_prefix_is_cached_unless_that_worker_is_much_busier():
    idle = PrefillCandidate(queued_tokens=0, cached_tokens=0, free_blocks=100)
    warm = PrefillCandidate(queued_tokens=50, cached_tokens=480, free_blocks=10)
    assert choose_prefill([idle, warm], prompt_tokens=512) == 1  # 82 tokens of work vs 512
    swamped = PrefillCandidate(queued_tokens=4000, cached_tokens=480, free_blocks=10)
    assert choose_prefill([idle, swamped], prompt_tokens=512) == 0


def test_prefill_load_balances_without_cache_and_breaks_ties_by_free_blocks():
    a = PrefillCandidate(queued_tokens=100, cached_tokens=0, free_blocks=5)
    b = PrefillCandidate(queued_tokens=10, cached_tokens=0, free_blocks=5)
    assert choose_prefill([a, b], prompt_tokens=64) == 1
    c = PrefillCandidate(queued_tokens=10, cached_tokens=0, free_blocks=50)
    assert choose_prefill([b, c], prompt_tokens=64) == 1
    assert choose_prefill([], prompt_tokens=64) is None


def test_decode_minimises_transfer_among_workers_with_room():
    holds_prefix = DecodeCandidate(transfer_blocks=1, consumed_blocks=2, free_blocks=3)
    empty = DecodeCandidate(transfer_blocks=8, consumed_blocks=8, free_blocks=100)
    assert choose_decode([empty, holds_prefix]) == 1
    full = DecodeCandidate(transfer_blocks=0, consumed_blocks=5, free_blocks=5)
    assert choose_decode([empty, full]) == 0  # no headroom left on the one that reuses all
    assert choose_decode([full]) is None  # wait for room
    same = DecodeCandidate(transfer_blocks=8, consumed_blocks=8, free_blocks=200)
    assert choose_decode([empty, same]) == 1  # tie on transfer: more free blocks
