"""How a pipeline step's requests are cut into micro-batches: contiguous, in order, never
an empty group, about equal token counts, at most one group per stage."""

from __future__ import annotations

import pytest

from services.worker.parallel.micro_batches import split_requests


@pytest.mark.parametrize(
    ("tokens", "parts", "groups"),
    [
        ([1] * 16, 2, [range(0, 8), range(8, 16)]),
        ([1] * 5, 2, [range(0, 3), range(3, 5)]),
        ([100, 1, 1], 2, [range(0, 1), range(1, 3)]),
        ([1, 1, 100], 2, [range(0, 2), range(2, 3)]),
        ([1, 1, 1], 3, [range(0, 1), range(1, 2), range(2, 3)]),
        ([64, 1, 1, 1, 1], 4, [range(0, 1), range(1, 2), range(2, 3), range(3, 5)]),
        ([7], 2, [range(0, 1)]),
        ([3, 4], 4, [range(0, 1), range(1, 2)]),
        ([1] * 6, 1, [range(0, 6)]),
        ([], 2, []),
    ],
)
def test_requests_are_cut_into_contiguous_balanced_groups(tokens, parts, groups):
    assert split_requests(tokens, parts) == groups


def test_every_split_covers_each_request_once_in_order():
    import random

    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.choice([1, 1, 1, 5, 32]) for _ in range(rng.randint(1, 20))]
        parts = rng.randint(1, 5)
        groups = split_requests(tokens, parts)
        assert [i for g in groups for i in g] == list(range(len(tokens)))
        assert 1 <= len(groups) <= parts and all(len(g) for g in groups)
        assert len(groups) == min(parts, len(tokens))


def test_parts_must_be_positive():
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_requests([1], 0)
