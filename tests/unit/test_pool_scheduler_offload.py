"""The host-memory offload tier as a pool's scheduler plans it (kv_offload.py): full
blocks saved after the step that fills them, a prefix the device cache evicted loaded
back from the tier instead of recomputed, the tier's own LRU, and isolation by key."""

from dataclasses import replace

from common.kv_events import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored
from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_offload import HostOffload
from services.scheduler.pool_scheduler import PoolScheduler
from tests.unit.test_pool_scheduler import make_request, result_for, step


def offload_sched(num_blocks=6, offload_blocks=8, block_size=4) -> PoolScheduler:
    return PoolScheduler(
        BlockManager(num_blocks, block_size),
        32,
        8,
        offload=HostOffload(offload_blocks, block_size),
    )


def test_full_blocks_are_saved_after_the_step_that_fills_them_and_only_once():
    s = offload_sched()
    first = make_request("first", 9, max_tokens=4)  # two full prompt blocks, then a third
    s.add(first)
    plan = step(s)
    table = s.blocks.table("first")
    assert plan.offload_out == [(table[0], 0), (table[1], 1)]  # saved after the forward
    assert plan.offload_in == []
    for _ in range(2):  # tokens 10 and 11: block 2 not full yet
        assert step(s).offload_out == []
    plan = step(s)  # token 12 fills block 2
    assert plan.offload_out == [(table[2], 2)]
    assert s.offload.num_saved_blocks == 3 and s.offload.num_cached_blocks == 3


def test_a_prefix_the_device_evicted_is_loaded_from_the_tier_not_recomputed():
    s = offload_sched(num_blocks=6, offload_blocks=16)
    first = make_request("first", 16, max_tokens=1)  # four full blocks
    s.add(first)
    step(s)
    other = make_request("other", 24, max_tokens=1, first=500)  # takes every device block
    s.add(other)
    step(s)
    assert s.blocks.cached_prefix(first.block_hashes, first.all_token_ids, 15) == []
    again = make_request("again", 18, max_tokens=1)  # first's prompt and two more tokens
    s.add(again)
    plan = step(s)
    (item,) = plan.scheduled
    # Blocks 0-3 come back from the tier (the 16th token is known; block 3 full), the
    # two new tokens are computed.
    assert (item.num_computed_before, item.num_new_tokens) == (16, 2)
    assert [dst for _, dst in plan.offload_in] == list(item.work.block_ids[:4])
    assert [src for src, _ in plan.offload_in] == [0, 1, 2, 3]
    assert again.num_cached_tokens == 16
    assert s.num_prefix_hit_tokens == 0  # none from the device cache
    assert s.offload.num_loaded_blocks == 4 and s.offload.num_hit_tokens == 16


def test_device_hits_come_first_and_the_tier_continues_the_run():
    s = offload_sched(num_blocks=10, offload_blocks=8)
    s.add(make_request("first", 12, max_tokens=1))  # blocks 0-2
    step(s)
    s.blocks.pool.reset_cache()  # the device forgets (as after an eviction)
    s.add(make_request("half", 5, max_tokens=1))  # block 0 back on the device (from tier)
    step(s)
    again = make_request("again", 13, max_tokens=1)
    s.add(again)
    plan = step(s)
    (item,) = plan.scheduled
    assert (item.num_computed_before, item.num_new_tokens) == (12, 1)
    assert [src for src, _ in plan.offload_in] == [1, 2]  # block 0 was a device hit
    assert [dst for _, dst in plan.offload_in] == list(item.work.block_ids[1:3])


def test_the_tier_is_an_lru_and_a_hit_refreshes():
    s = offload_sched(num_blocks=40, offload_blocks=2, block_size=4)
    a = make_request("a", 5, max_tokens=1, first=100)  # one full block each
    b = make_request("b", 5, max_tokens=1, first=200)
    c = make_request("c", 5, max_tokens=1, first=300)
    for r in (a, b):
        s.add(r)
        step(s)
    s.blocks.pool.reset_cache()
    s.add(make_request("a2", 5, max_tokens=1, first=100))  # hits a's block: a is newest
    assert step(s).offload_in
    s.add(c)
    plan = step(s)  # saving c evicts the least recently used: b's offload block 1
    assert [dst for _, dst in plan.offload_out] == [1]
    s.blocks.pool.reset_cache()
    s.add(make_request("a3", 5, max_tokens=1, first=100))
    assert step(s).offload_in  # a stayed
    s.blocks.pool.reset_cache()
    s.add(make_request("b2", 5, max_tokens=1, first=200))
    assert step(s).offload_in == []  # b is gone from the tier


def test_another_salt_never_hits_the_tier_and_prompt_logprobs_compute_everything():
    s = offload_sched(num_blocks=6)
    s.add(make_request("first", 16, max_tokens=1))
    step(s)
    s.blocks.pool.reset_cache()
    salted = make_request("salted", 18, max_tokens=1)
    salted.hash_root = b"\x01" * 32  # another cache_salt: another chain of keys
    s.add(salted)
    assert step(s).offload_in == []
    s.blocks.pool.reset_cache()
    scored = make_request("scored", 18, max_tokens=1)
    scored.sampling = scored.sampling.__class__(prompt_logprobs=0)
    s.add(scored)
    plan = step(s)
    assert plan.offload_in == [] and plan.scheduled[0].num_computed_before == 0


# -- the disk tier behind the host tier ----------------------------------------------------
def disk_sched(offload_blocks=2) -> PoolScheduler:
    return PoolScheduler(
        BlockManager(40, 4), 32, 8, offload=HostOffload(offload_blocks, 4, disk_hashes=())
    )


def answer(s: PoolScheduler, plan, **disk) -> None:
    """The worker's result for `plan`, with what its disk tier did."""
    result = result_for(plan)
    s.update(replace(result, **disk))
    s.check_integrity()


def test_blocks_the_host_tier_lets_go_are_written_to_disk_and_read_back_on_a_hit():
    s = disk_sched(offload_blocks=2)
    a = make_request("a", 9, max_tokens=1, first=100)  # two full blocks
    s.add(a)
    step(s)
    s.add(make_request("b", 9, max_tokens=1, first=200))
    plan = step(s)  # b's two saves push a's two blocks out of the host tier (tail first)
    assert [d.block_hash for d in plan.disk_saves] == a.block_hashes[1::-1]
    assert {d.offload_block for d in plan.disk_saves} == {0, 1}
    assert all(d.root == a.hash_root for d in plan.disk_saves)
    s.blocks.pool.reset_cache()  # the device forgets
    again = make_request("again", 10, max_tokens=1, first=100)
    s.add(again)
    plan = s.schedule()  # a's blocks are on disk: read into held offload blocks; it waits
    assert plan.scheduled == [] and not plan.is_empty
    assert [d.block_hash for d in plan.disk_loads] == a.block_hashes[:2]
    twin = make_request("twin", 10, max_tokens=1, first=100)
    s.add(twin)
    assert s.schedule().is_empty  # the same blocks are on their way: no second read
    answer(s, plan, disk_loaded=tuple(a.block_hashes[:2]))
    plan = step(s)  # both start from the two blocks, now in the host tier
    assert [(i.request.request_id, i.num_computed_before) for i in plan.scheduled] == [
        ("again", 8),
        ("twin", 8),
    ]
    # `again` loads them from the tier; `twin`, planned after it, hits them on the device.
    assert sorted(src for src, _ in plan.offload_in) == [0, 1]
    # a's two blocks went to disk, then b's two (the reads took their offload blocks).
    assert s.offload.num_disk_loaded_blocks == 2 and s.offload.num_disk_saved_blocks == 4


def test_a_block_the_disk_could_not_serve_is_computed_and_leaves_the_index():
    s = disk_sched(offload_blocks=2)
    a = make_request("a", 9, max_tokens=1, first=100)
    s.add(a)
    step(s)
    s.add(make_request("b", 9, max_tokens=1, first=200))
    step(s)
    s.blocks.pool.reset_cache()
    again = make_request("again", 10, max_tokens=1, first=100)
    s.add(again)
    plan = s.schedule()
    k0, k1 = a.block_hashes[:2]
    answer(s, plan, disk_loaded=(k0,), disk_failed=(k1,))  # a corrupt or missing file
    assert k1 not in s.offload.disk and k0 in s.offload.disk
    (item,) = step(s).scheduled
    assert item.num_computed_before == 4  # block 0 from the tier, the rest computed
    answer_removed = disk_sched()
    answer_removed.offload.disk[b"x" * 32] = None
    answer_removed.offload.disk_results((), (), (b"x" * 32,))  # the worker's LRU let it go
    assert answer_removed.offload.num_disk_blocks == 0


def test_one_step_never_writes_an_offload_block_twice_nor_sends_unwritten_bytes_to_disk():
    s = disk_sched(offload_blocks=1)
    s.add(make_request("a", 9, max_tokens=1, first=100))  # two blocks, one offload block
    plan = step(s)
    assert len(plan.offload_out) == 1 and plan.disk_saves == []


def test_a_step_saves_at_most_one_block_into_each_offload_block():
    s = offload_sched(num_blocks=20, offload_blocks=3)
    s.add(make_request("long", 21, max_tokens=1))  # five full blocks in one step
    plan = step(s)
    assert [dst for _, dst in plan.offload_out] == [0, 1, 2]  # the first three; no reuse


def test_a_finished_chain_leaves_the_tier_tail_first_so_its_head_stays_longest():
    """A chain is no use past its first missing block: the tier must evict a finished
    request's last block first (as the device pool frees tables tail first)."""
    s = offload_sched(num_blocks=40, offload_blocks=6)
    long = make_request("long", 25, max_tokens=1, first=100)  # six full blocks
    s.add(long)
    step(s)
    s.add(make_request("other", 13, max_tokens=1, first=500))  # three more: evicts three
    step(s)
    s.blocks.pool.reset_cache()
    again = make_request("again", 26, max_tokens=1, first=100)
    s.add(again)
    (item,) = step(s).scheduled
    assert item.num_computed_before == 12  # blocks 0-2 still in the tier, in a run


def test_the_tiers_publish_kv_events_with_their_medium_and_chain():
    s = PoolScheduler(
        BlockManager(40, 4, kv_events=True), 32, 8,
        offload=HostOffload(2, 4, disk_hashes=()),
    )  # fmt: skip
    a = make_request("a", 9, max_tokens=1, first=100)
    s.add(a)
    step(s)
    (stored,) = s.offload.take_kv_events()
    assert isinstance(stored, BlockStored) and stored.medium == MEDIUM_CPU
    assert stored.block_hashes == tuple(a.block_hashes[:2]) and stored.parent_block_hash is None
    s.add(make_request("b", 9, max_tokens=1, first=200))
    step(s)  # a's blocks leave the host tier for the disk
    events = s.offload.take_kv_events()
    assert {e.medium for e in events if isinstance(e, BlockRemoved)} == {MEDIUM_CPU}
    on_disk = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_DISK]
    assert {h for e in on_disk for h in e.block_hashes} == set(a.block_hashes[:2])
    snapshot = s.offload.kv_snapshot()
    assert {e.medium for e in snapshot} == {MEDIUM_CPU, MEDIUM_DISK}
    s.offload.disk_results((), (), (a.block_hashes[1],))  # the disk's LRU let one go
    assert s.offload.take_kv_events() == [BlockRemoved((a.block_hashes[1],), MEDIUM_DISK)]


def test_a_block_a_disk_read_takes_from_the_host_tier_is_written_to_disk_first():
    s = disk_sched(offload_blocks=2)
    a = make_request("a", 9, max_tokens=1, first=100)
    s.add(a)
    step(s)
    b = make_request("b", 9, max_tokens=1, first=200)  # pushes a to disk; b now in the tier
    s.add(b)
    step(s)
    s.blocks.pool.reset_cache()
    s.add(make_request("again", 10, max_tokens=1, first=100))
    plan = s.schedule()  # reading a's blocks back takes b's offload blocks: b goes to disk
    assert {d.block_hash for d in plan.disk_saves} == set(b.block_hashes[:2])
    assert {d.block_hash for d in plan.disk_loads} == set(a.block_hashes[:2])
    assert {d.offload_block for d in plan.disk_saves} == {d.offload_block for d in plan.disk_loads}
