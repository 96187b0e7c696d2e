"""A decode pool's offload tier at the hand-off (handoff_tier.py): what arrived is saved
with the pool's next step, a later hand-off's blocks the tier holds are loaded into the
request's fresh blocks with the pool's next step instead of moved, and a transfer given
up takes its loads and holds back."""

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_offload import HostOffload
from services.scheduler.pool_scheduler import PoolScheduler
from tests.unit.test_pool_scheduler import make_request


def decode_pool(num_blocks=8, offload_blocks=8, block_size=4) -> PoolScheduler:
    return PoolScheduler(
        BlockManager(num_blocks, block_size), 32, 8, offload=HostOffload(offload_blocks, block_size)
    )


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
    assert s.offload.handoff.hits(again, len(hits), 14) == []
    # ...until the device evicts them: then the tier's run after the device hits.
    s.blocks.allocate("flood", 32, hits=[])  # every device block
    s.blocks.free("flood")
    assert s.blocks.cached_prefix(again.block_hashes, again.all_token_ids, 14) == []
    tier = s.offload.handoff.hits(again, 0, 14)
    assert tier == [0, 1]
    fresh, _ = s.blocks.allocate("again", 14, hits=[])
    s.offload.handoff.hold("again", tier, fresh[:2])
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
    s.offload.handoff.hold("again", tier, fresh)
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
    assert s.offload.handoff.hits(again, 0, 8) == []
