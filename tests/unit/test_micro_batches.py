"""How a pipeline step's requests are cut into micro-batches: contiguous, in order, never
an empty group, about equal token counts, at most one group per stage."""

from __future__ import annotations

import pytest

from services.worker.micro_batches import split_requests


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


def test_a_reader_before_its_writer_keeps_the_step_in_one_micro_batch():
    """Request 0 hit the prefix cache on block 7, which request 1 (later in the step, so in
    the later micro-batch) writes this step: splitting would let request 0 attend over KV
    not written yet."""
    from services.worker.micro_batches import keeps_writers_first
    from services.worker.models.attention_metadata import SequenceSlice

    writer = SequenceSlice(0, 8, [7, 8])  # writes blocks 7 and 8 (block size 4)
    reader = SequenceSlice(4, 4, [7, 9])  # reads block 7, writes block 9
    groups = [range(0, 1), range(1, 2)]
    assert not keeps_writers_first([reader, writer], groups, 4)
    assert keeps_writers_first([writer, reader], groups, 4)  # the writer goes first: fine
    assert keeps_writers_first([reader, writer], [range(0, 2)], 4)  # one pass: fine
    # A request reading only its own partly filled block, and unrelated decodes, split freely.
    own = SequenceSlice(5, 1, [3, 4])
    decode = SequenceSlice(9, 1, [5, 6, 10])
    assert keeps_writers_first([own, decode], groups, 4)
    assert keeps_writers_first([decode, own], groups, 4)
