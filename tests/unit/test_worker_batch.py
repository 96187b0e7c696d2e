"""The worker's persistent batch: full data once, deltas after, plans checked."""

import pytest

from common.sampling import SamplingParams
from common.step_plan import CachedRequestData, NewRequestData
from services.worker.batch import PersistentBatch, PlanError


def new(rid="a", tokens=(1, 2, 3, 4, 5), blocks=(3, 1), computed=0, scheduled=5):
    return NewRequestData(rid, list(tokens), list(blocks), computed, scheduled, SamplingParams())


def test_new_request_then_deltas_advance_and_append_sampled_tokens():
    batch = PersistentBatch(block_size=4, num_blocks=8, vocab_size=100)
    (work,) = batch.apply([], [new()], [])
    assert work.samples and work.num_new_tokens == 5
    batch.complete([work], {"a": 42})
    request = batch.requests["a"]
    assert request.token_ids == [1, 2, 3, 4, 5, 42] and request.num_computed_tokens == 5
    (work,) = batch.apply([], [], [CachedRequestData("a", [6], 1)])
    assert request.block_ids == [3, 1, 6]
    assert work.samples
    batch.complete([work], {"a": 43})
    assert request.num_computed_tokens == 6


def test_partial_chunk_does_not_sample():
    batch = PersistentBatch(block_size=4, num_blocks=8, vocab_size=100)
    (work,) = batch.apply([], [new(scheduled=3)], [])
    assert not work.samples


def test_finished_ids_are_dropped_before_new_requests_are_added():
    batch = PersistentBatch(block_size=4, num_blocks=8, vocab_size=100)
    batch.apply([], [new()], [])
    batch.apply(["a"], [new()], [])  # same id re-sent after a drop: accepted
    assert len(batch) == 1
    batch.apply(["a"], [], [])
    assert len(batch) == 0


@pytest.mark.parametrize(
    "plan, message",
    [
        (lambda b: b.apply([], [new(), new()], []), "already in the batch"),
        (lambda b: b.apply([], [], [CachedRequestData("zz", [], 1)]), "not in the batch"),
        (lambda b: b.apply([], [new(blocks=(3,))], []), "cannot hold"),
        (lambda b: b.apply([], [new(blocks=(3, 99))], []), "outside the pool"),
        (lambda b: b.apply([], [new(scheduled=6)], []), "cannot compute"),
        (lambda b: b.apply([], [new(scheduled=0)], []), "cannot compute"),
        (lambda b: b.apply([], [new(tokens=(1, 2, 3, 4, 100))], []), "outside the vocab"),
    ],
)
def test_plans_that_do_not_fit_are_rejected(plan, message):
    batch = PersistentBatch(block_size=4, num_blocks=8, vocab_size=100)
    with pytest.raises(PlanError, match=message):
        plan(batch)


def test_num_prompt_tokens_defaults_to_every_known_token():
    batch = PersistentBatch(block_size=4, num_blocks=8, vocab_size=100)
    batch.apply([], [new("a")], [])
    resumed = NewRequestData("b", [1, 2, 3, 4, 5, 6], [4, 5], 0, 6, SamplingParams(), 4)
    batch.apply([], [resumed], [])
    assert batch.requests["a"].num_prompt_tokens == 5  # a plan that does not say: all prompt
    assert batch.requests["b"].num_prompt_tokens == 4  # prompt + 2 outputs (recompute)
