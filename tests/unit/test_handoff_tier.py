"""A decode pool's offload tiers at the hand-off (handoff_tier.py): what arrived is saved
with the pool's next step, a later hand-off's blocks the host tier holds are loaded into
the request's fresh blocks with the pool's next step instead of moved, those its disk
holds are read with that step and loaded after it (a failed read is the hand-off's to
move), and a transfer given up takes its loads, reads and holds back."""

from common.step_result import StepResult
from services.scheduler.block_manager import BlockManager
from services.scheduler.handoff_tier import TierRun
from services.scheduler.kv_offload import HostOffload
from services.scheduler.pool_scheduler import PoolScheduler
from tests.kv_offload_blocks import OTHER_ROOT
from tests.unit.test_pool_scheduler import make_request


def decode_pool(num_blocks=8, offload_blocks=8, block_size=4, disk=None) -> PoolScheduler:
    """`disk`: the block hashes its disk tier holds (None: it has none)."""
    offload = HostOffload(offload_blocks, block_size, disk_hashes=disk)
    return PoolScheduler(BlockManager(num_blocks, block_size), 32, 8, offload=offload)


def arrive(s: PoolScheduler, request) -> list[int]:
    """What the hand-off does when a transfer ends: the blocks held and cached."""
    blocks, _ = s.blocks.allocate(request.request_id, request.num_computed_tokens, hits=[])
    cached = s.blocks.cache_full_blocks(
        request.request_id, request.block_hashes, request.all_token_ids,
        request.num_computed_tokens, request.chain_origin,
    )  # fmt: skip
    s.offload.handoff.save_arrival(request.request_id, cached, request.hash_root)
    return blocks


def computed(name: str, n: int, first: int = 0):
    request = make_request(name, n, max_tokens=4, first=first)
    request.num_computed_tokens = n
    request.update_block_hashes(4)
    return request


def test_arrived_blocks_are_saved_with_the_next_step_and_loaded_by_a_later_handoff():
    s = decode_pool()
    first = computed("first", 9)  # two full blocks
    table = arrive(s, first)
    plan = s.schedule()
    assert plan.offload_out == [(table[0], 0), (table[1], 1)]  # after that step's forward
    s.offload.release("first")
    s.blocks.free("first")
    # The next turn's hand-off: the device still caches nothing the tier does not...
    again = computed("again", 14)  # first's 9 tokens (same ids), then 5 more
    assert again.block_hashes[:2] == first.block_hashes[:2]
    hits = s.blocks.cached_prefix(again.block_hashes, again.all_token_ids, 14)
    assert len(hits) == 2  # still on the device: nothing for the tier to load
    assert s.offload.handoff.hits(again, len(hits), 14) == TierRun(2)
    # ...until the device evicts them: then the tier's run after the device hits.
    s.blocks.allocate("flood", 32, hits=[])  # every device block
    s.blocks.free("flood")
    assert s.blocks.cached_prefix(again.block_hashes, again.all_token_ids, 14) == []
    tier = s.offload.handoff.hits(again, 0, 14)
    assert tier == TierRun(0, (0, 1)) and tier.num_blocks == 2
    fresh, _ = s.blocks.allocate("again", 14, hits=[])
    assert s.offload.handoff.hold(again, tier, fresh[:2]) == 2
    plan = s.schedule()
    assert plan.offload_in == [(0, fresh[0]), (1, fresh[1])]
    assert not plan.is_empty  # sent even if nothing else runs
    assert s.offload.num_loaded_blocks == 2 and s.offload.num_hit_tokens == 0
    assert s.schedule().offload_in == []  # once
    s.offload.release("again")
    s.offload.check_integrity()


def test_a_transfer_given_up_takes_its_loads_and_holds_back():
    s = decode_pool()
    first = computed("first", 8)
    arrive(s, first)
    s.schedule()
    s.offload.release("first")
    s.blocks.free("first")
    s.blocks.allocate("flood", 32, hits=[])
    s.blocks.free("flood")
    again = computed("again", 8)
    tier = s.offload.handoff.hits(again, 0, 8)
    fresh, _ = s.blocks.allocate("again", 8, hits=[])
    s.offload.handoff.hold(again, tier, fresh)
    assert s.offload.pool.num_free == 6  # the two held
    s.offload.handoff.drop("again")
    assert s.schedule().offload_in == []
    assert s.offload.pool.num_free == 8
    s.offload.check_integrity()


def test_prompt_logprobs_requests_take_nothing_from_the_tier():
    s = decode_pool()
    first = computed("first", 8)
    arrive(s, first)
    s.schedule()
    again = computed("again", 8)
    again.sampling = again.sampling.__class__(**{**again.sampling.__dict__, "prompt_logprobs": 0})
    assert s.offload.handoff.hits(again, 0, 8).num_blocks == 0


# -- the disk tier behind it -------------------------------------------------------------------
def on_disk(n: int = 16, name: str = "again"):
    """A decode pool whose disk holds the first three blocks of a request of `n` tokens
    (as a restarted worker reports them), its host tier 4 free blocks; and the request."""
    request = computed(name, n)
    return decode_pool(offload_blocks=4, disk=request.block_hashes[:3]), request


def read_result(plan, failed=()) -> StepResult:
    """The worker's answer to a plan that reads the disk: every read loaded but `failed`."""
    keys = [d.block_hash for d in plan.disk_loads]
    loaded = tuple(k for k in keys if k not in failed)
    return StepResult(0, {}, 0.0, disk_loaded=loaded, disk_failed=tuple(failed))


def reads_of(plan, keys) -> tuple[int, ...]:
    """The offload blocks a plan reads these block hashes into."""
    blocks = {d.block_hash: d.offload_block for d in plan.disk_loads}
    return tuple(blocks[k] for k in keys)


def test_a_handoff_reads_its_disk_run_and_loads_what_was_read_the_step_after():
    s, again = on_disk()
    keys = again.block_hashes
    run = s.offload.handoff.hits(again, 0, 16)
    assert run == TierRun(0, (), 3)  # blocks 0-2 on disk; block 3 moves
    fresh, _ = s.blocks.allocate("again", 16, hits=[])
    assert s.offload.handoff.hold(again, run, fresh[:3]) == 3
    assert s.offload.handoff.hits(again, 0, 16).num_disk == 0  # being read: not twice
    plan = s.schedule()
    assert [d.block_hash for d in plan.disk_loads] == keys[:3]
    reads = {d.block_hash: d.offload_block for d in plan.disk_loads}
    assert all(d.root == again.hash_root for d in plan.disk_loads)
    assert plan.offload_in == [] and not plan.is_empty  # sent for the reads alone
    assert s.offload.pool.num_free == 1
    s.check_integrity()
    assert s.schedule().disk_loads == []  # once
    s.update(read_result(plan, failed=[keys[1]]))  # block 1's file was bad
    assert s.offload.handoff.take_outcomes() == {"again": [1]}  # moves after all
    assert s.offload.handoff.take_outcomes() == {}
    loads = s.schedule().offload_in
    assert loads == [(reads[keys[0]], fresh[0]), (reads[keys[2]], fresh[2])]
    assert s.offload.num_disk_loaded_blocks == 2 and s.offload.num_disk_failed_blocks == 1
    assert keys[1] not in s.offload.disk and keys[0] in s.offload.disk
    # What was read joined the host tier, held for the request while it runs.
    assert s.offload.pool.lookup(keys[0], again.all_token_ids[:4]) == reads[keys[0]]
    assert s.offload.pool.lookup(keys[1], again.all_token_ids[4:8]) is None
    assert s.offload.pool.num_free == 2
    s.check_integrity()
    s.offload.release("again")
    assert s.offload.pool.num_free == 4
    s.offload.check_integrity()


def test_the_disk_run_is_only_as_long_as_the_free_offload_blocks_and_cache_salt_apart():
    s, again = on_disk()
    held = computed("held", 12, first=100)
    arrive(s, held)
    s.schedule()  # its three blocks saved and held by it: one offload block free
    assert s.offload.handoff.hits(again, 0, 16) == TierRun(0, (), 1)
    other = make_request("other", 16, max_tokens=4)
    other.hash_root = OTHER_ROOT  # the same tokens under another cache_salt
    other.num_computed_tokens = 16
    other.update_block_hashes(4)
    assert s.offload.handoff.hits(other, 0, 16).num_blocks == 0
    logprobs = computed("logprobs", 16)
    logprobs.sampling = logprobs.sampling.__class__(
        **{**logprobs.sampling.__dict__, "prompt_logprobs": 0}
    )
    assert s.offload.handoff.hits(logprobs, 0, 16).num_blocks == 0


def test_a_read_takes_an_offload_block_whose_block_goes_to_disk_first():
    s, again = on_disk()
    kept = computed("kept", 16, first=100)
    arrive(s, kept)
    s.schedule()  # the host tier: kept's four blocks
    s.offload.release("kept")
    run = s.offload.handoff.hits(again, 0, 16)
    fresh, _ = s.blocks.allocate("again", 16, hits=[])
    s.offload.handoff.hold(again, run, fresh[:3])
    plan = s.schedule()
    # The LRU ones (kept's tail first out) are written before the reads reuse their blocks
    # (saved by the plan before: held between plans, the reads go into the next one).
    assert [d.block_hash for d in plan.disk_saves] == kept.block_hashes[3:0:-1]
    assert [d.offload_block for d in plan.disk_saves] == [d.offload_block for d in plan.disk_loads]
    assert all(k in s.offload.disk for k in kept.block_hashes[1:])
    # kept's block 0 is still in the host tier; no offload block is left to read 1 into.
    assert s.offload.handoff.hits(kept, 0, 16) == TierRun(0, (0,), 0)
    s.update(read_result(plan))
    assert s.offload.handoff.take_outcomes() == {"again": []}
    s.offload.handoff.drop("again")
    s.offload.check_integrity()
    assert s.offload.pool.num_free == 4


def test_a_transfer_given_up_calls_off_its_reads_or_lets_them_end_as_anyones():
    s, again = on_disk()
    keys = again.block_hashes
    fresh, _ = s.blocks.allocate("again", 16, hits=[])
    s.offload.handoff.hold(again, s.offload.handoff.hits(again, 0, 16), fresh[:3])
    s.offload.handoff.drop("again")  # before any plan carried them: called off
    assert s.schedule().is_empty
    assert s.offload.pool.num_free == 4 and s.offload.num_cached_blocks == 0
    assert all(k in s.offload.disk for k in keys[:3])  # still on disk
    s.offload.check_integrity()
    # Given up once its reads are planned: they end as anyone's (what loads joins the tier).
    s.offload.handoff.hold(again, s.offload.handoff.hits(again, 0, 16), fresh[:3])
    plan = s.schedule()
    s.offload.handoff.drop("again")
    assert s.offload.pool.num_free == 1  # still held for the reads under way
    s.offload.check_integrity()
    s.update(read_result(plan, failed=[keys[2]]))
    assert s.offload.handoff.take_outcomes() == {}
    assert s.schedule().is_empty  # no loads
    assert s.offload.pool.num_free == 4 and s.offload.num_cached_blocks == 2
    assert s.offload.handoff.hits(again, 0, 16) == TierRun(0, (reads_of(plan, keys[:2])), 0)
    s.offload.check_integrity()
