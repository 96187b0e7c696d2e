"""The scheduler's WorkerBatch: which requests the worker's persistent batch holds, and
what the next plan drops (a request that left with its KV stays until its blocks are freed)."""

from services.scheduler.worker_batch import WorkerBatch


def test_a_member_that_leaves_the_pool_is_dropped_once_with_the_next_plan():
    batch = WorkerBatch()
    batch.join("a")
    batch.join("b")
    batch.drop("a")
    batch.drop("a")  # twice: still one drop
    batch.drop("never-joined")
    assert batch.take_drops() == ["a"] and batch.take_drops() == []
    assert not batch.has("a") and batch.has("b")


def test_a_request_that_left_with_its_kv_stays_until_its_blocks_are_freed_oldest_first():
    batch = WorkerBatch()
    for rid in ("a", "b", "c"):
        batch.join(rid)
    batch.leave("b")
    batch.leave("a")
    batch.leave("not-on-the-worker")  # never ran here: nothing to keep
    held = {"a", "b"}
    batch.drop_departed(held.__contains__)
    assert batch.take_drops() == []  # both still hold blocks here
    held.clear()
    batch.drop_departed(held.__contains__)
    assert batch.take_drops() == ["b", "a"]
    assert batch.has("c") and not batch.has("a")


def test_a_move_called_off_keeps_the_request_and_one_back_early_is_dropped_to_rejoin():
    batch = WorkerBatch()
    batch.join("stays")
    batch.join("returns")
    batch.leave("stays")
    batch.stay("stays")  # the drain ended before a decode pool pulled it
    batch.drop_departed(lambda rid: False)
    assert batch.take_drops() == [] and batch.has("stays")
    batch.leave("returns")
    batch.come_back("returns")  # queued here again: its old entry goes
    batch.come_back("stays")  # never left: nothing to drop
    assert batch.take_drops() == ["returns"] and not batch.has("returns")
