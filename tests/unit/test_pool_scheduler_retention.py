"""Retention hints as a pool's scheduler applies them (`kv_retention.py`): a finished
request that asked for `kv_retention_s` keeps its prompt's and output's blocks in the
device pool and the host tier past a flood of other requests, the disk gets its deadline
with the save (or, for blocks only the disk holds when it finishes, with the next plan),
a later request extends it only by asking, and after the deadline the blocks are ordinary
LRU blocks; a sequence no request holds (a beam search's hypothesis) is retained by its
hashes in every tier. The clock is the test's; no block leaks."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_offload import HostOffload
from services.scheduler.kv_retention import retain_sequence
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.request import Request
from tests.unit.test_pool_scheduler import ROOT, make_request, result_for, step


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def retention_sched(clock: Clock, num_blocks=8, offload_blocks=0, disk=False) -> PoolScheduler:
    offload = None
    if offload_blocks:
        offload = HostOffload(offload_blocks, 4, disk_hashes=() if disk else None, clock=clock)
    return PoolScheduler(BlockManager(num_blocks, 4, clock=clock), 64, 8, offload=offload)


def run(s: PoolScheduler, request) -> None:
    s.add(request)
    while s.holds(request):
        step(s)


def device_hit_tokens(s: PoolScheduler, request) -> int:
    found = s.blocks.cached_prefix(request.block_hashes, request.all_token_ids, 10**6)
    return len(found) * s.blocks.block_size


def flood(s: PoolScheduler, count: int, first: int = 1000) -> None:
    for i in range(count):
        run(s, make_request(f"flood{i}", 13, max_tokens=1, first=first + 100 * i))


def test_a_retained_conversation_survives_a_flood_on_the_device_and_then_expires():
    clock = Clock()
    s = retention_sched(clock)
    kept = make_request("kept", 9, max_tokens=4)  # 12 known tokens: 3 full blocks
    kept.kv_retention_s = 60.0
    run(s, kept)
    assert device_hit_tokens(s, kept) == 12
    assert s.blocks.pool.num_retained_free == 3
    plain = make_request("plain", 9, max_tokens=4, first=50)
    run(s, plain)
    flood(s, 3)  # 4 blocks each: the 8-block pool turns over three times
    assert device_hit_tokens(s, kept) == 12  # every free unretained block went first
    assert device_hit_tokens(s, plain) == 0
    clock.now += 61  # past the deadline: ordinary LRU blocks, the oldest
    flood(s, 1)
    assert device_hit_tokens(s, kept) == 0
    s.check_integrity()
    assert s.blocks.num_free_blocks == 8


def test_a_later_request_extends_the_deadline_only_by_asking():
    clock = Clock()
    s = retention_sched(clock)
    kept = make_request("kept", 9, max_tokens=4)
    kept.kv_retention_s = 30.0
    run(s, kept)
    table_hits = s.blocks.cached_prefix(kept.block_hashes, kept.all_token_ids, 10**6)
    deadline = clock.now + 30.0
    assert {s.blocks.pool.retained_until(b) for b in table_hits} == {deadline}
    clock.now += 10
    again = make_request("again", 9, max_tokens=1)  # its prompt, no retention asked
    run(s, again)
    assert {s.blocks.pool.retained_until(b) for b in table_hits} == {deadline}
    longer = make_request("longer", 9, max_tokens=1)
    longer.kv_retention_s = 50.0
    run(s, longer)  # hits the first two blocks: their deadline moves
    assert [s.blocks.pool.retained_until(b) for b in table_hits[:2]] == [clock.now + 50] * 2
    shorter = make_request("shorter", 9, max_tokens=1)
    shorter.kv_retention_s = 1.0
    run(s, shorter)  # an earlier deadline changes nothing
    assert [s.blocks.pool.retained_until(b) for b in table_hits[:2]] == [clock.now + 50] * 2


def test_the_host_tier_retains_the_finished_request_s_blocks_too():
    clock = Clock()
    s = retention_sched(clock, num_blocks=8, offload_blocks=6)
    kept = make_request("kept", 9, max_tokens=4)
    kept.kv_retention_s = 60.0
    run(s, kept)
    assert s.offload.pool.num_retained_free == 3
    flood(s, 4)  # 12 blocks through a 6-block tier: only the unretained ones turn over
    found = [s.offload.pool.lookup(k, kept.all_token_ids[i * 4 : i * 4 + 4])
             for i, k in enumerate(kept.block_hashes[:3])]  # fmt: skip
    assert None not in found
    s.check_integrity()


def test_a_retained_block_goes_to_disk_with_its_deadline_and_an_extension_is_sent_again():
    clock = Clock()
    s = retention_sched(clock, num_blocks=40, offload_blocks=3, disk=True)
    kept = make_request("kept", 9, max_tokens=4)
    kept.kv_retention_s = 60.0
    run(s, kept)
    deadline = clock.now + 60.0
    # Nothing else is free in the tier: the next saves push the retained blocks to disk,
    # earliest deadline first, each with its deadline.
    other = make_request("other", 13, max_tokens=1, first=700)
    s.add(other)
    plan = s.schedule()
    s.update(result_for(plan))
    assert {d.block_hash for d in plan.disk_saves} == set(kept.block_hashes[:3])
    assert {d.retain_until for d in plan.disk_saves} == {deadline}
    # A later turn asks for longer: loaded back into the tier, then retained there
    # again; when the tier lets them go once more, the disk holds them already, and only
    # the longer deadline is sent.
    clock.now += 5
    s.blocks.pool.reset_cache()  # the device forgets (as after a long flood)
    again = Request("again", [*kept.all_token_ids, 50], 1, hash_root=ROOT, kv_retention_s=100.0)
    s.add(again)
    plan = s.schedule()  # reads from disk; it waits for them
    assert {d.block_hash for d in plan.disk_loads} == set(kept.block_hashes[:3])
    s.update(result_for(plan))
    loaded = tuple(d.block_hash for d in plan.disk_loads)
    s.offload.disk_results(loaded, (), ())
    while s.holds(again):
        step(s)
    saved_before = s.offload.num_disk_saved_blocks
    third = make_request("third", 13, max_tokens=1, first=900)
    s.add(third)
    plan = s.schedule()
    s.update(result_for(plan))
    extended = [d for d in plan.disk_saves if d.block_hash in kept.block_hashes[:3]]
    assert extended and {d.retain_until for d in extended} == {clock.now + 100.0}
    assert s.offload.num_disk_saved_blocks - saved_before == len(plan.disk_saves) - len(
        extended
    )  # an extension is no new disk block
    s.check_integrity()


def test_requests_without_retention_retain_nothing():
    clock = Clock()
    s = retention_sched(clock, offload_blocks=6)
    run(s, make_request("a", 9, max_tokens=4))
    assert s.blocks.pool.num_retained_free == 0 and s.offload.pool.num_retained_free == 0


def test_a_finished_retained_request_moves_the_disk_deadline_of_its_blocks_on_disk_only():
    """Its prompt was a device prefix hit whose host copies the tier had let go to disk
    meanwhile: at its finish, those blocks' disk deadline moves with the next plan (sent
    on its own: nothing else runs), without a save; its block the host tier holds is
    retained there. An earlier deadline, or no retention, sends nothing."""
    clock = Clock()
    s = retention_sched(clock, num_blocks=40, offload_blocks=3, disk=True)
    first = make_request("first", 13, max_tokens=1)  # 3 full blocks, into the host tier
    run(s, first)
    run(s, make_request("other", 13, max_tokens=1, first=700))  # pushes them to disk
    on_disk = first.block_hashes[:3]
    assert set(on_disk) <= set(s.offload.disk)
    assert all(s.offload.pool.lookup(k, first.all_token_ids[i * 4 : i * 4 + 4]) is None
               for i, k in enumerate(on_disk))  # fmt: skip

    def finish(rid: str, retention: float):
        request = Request(rid, [*first.all_token_ids[:12], 60, 61, 62, 63, 64], 1,
                          hash_root=ROOT, kv_retention_s=retention)  # fmt: skip
        run(s, request)
        assert request.num_cached_tokens >= 12  # a device prefix hit
        plan = s.schedule()
        if not plan.is_empty:
            s.update(result_for(plan))
        s.check_integrity()
        return plan

    plan = finish("kept", 60.0)
    assert [(r.block_hash, r.retain_until) for r in plan.disk_retains] == [
        (k, clock.now + 60.0) for k in on_disk
    ]
    assert not plan.scheduled and not plan.disk_saves  # only the deadlines: nothing written
    assert s.offload.pool.num_retained_free == 1  # its 4th block, held in the host tier
    clock.now += 5
    assert finish("shorter", 10.0).disk_retains == []  # an earlier deadline: nothing
    assert finish("plain", 0.0).disk_retains == []
    plan = finish("longer", 100.0)
    assert {r.retain_until for r in plan.disk_retains} == {clock.now + 100.0}
    assert [r.block_hash for r in plan.disk_retains] == on_disk
    # A block the disk let go meanwhile gets no deadline.
    s.offload.disk_results((), (), [on_disk[0]])
    clock.now += 5
    assert [r.block_hash for r in finish("after", 200.0).disk_retains] == on_disk[1:]


def test_a_sequence_no_request_holds_is_retained_by_its_hashes_in_every_tier():
    """`retain_sequence` (a beam search's hypotheses: the beams that computed them are
    gone): each of its computed full blocks is retained where a tier holds it — the
    device's cached free blocks, the host tier's, and on disk (the next plan) those only
    the disk holds."""
    clock = Clock()
    s = retention_sched(clock, num_blocks=40, offload_blocks=3, disk=True)
    first = make_request("first", 9, max_tokens=1)  # 2 full blocks, into the host tier
    run(s, first)
    run(s, make_request("other", 13, max_tokens=1, first=700))  # pushes them to disk
    second = Request("second", [*first.all_token_ids[:8], *range(60, 68)], 1, hash_root=ROOT)
    run(s, second)  # a 2-block device hit; its 2 new blocks go to the host tier
    assert s.blocks.pool.num_retained_free == s.offload.pool.num_retained_free == 0
    hypothesis = Request("hyp", second.prompt_token_ids, 2, output_token_ids=[99, 98])
    hypothesis.hash_root, hypothesis.kv_retention_s = ROOT, 60.0
    hypothesis.num_computed_tokens = 16 + 2 - 1  # its last token was never computed
    assert retain_sequence(s.blocks, s.offload, hypothesis) == clock.now + 60.0
    assert s.blocks.pool.num_retained_free == 4  # 17 computed tokens: 4 full blocks
    assert s.offload.pool.num_retained_free == 2  # second's, in the host tier
    plan = s.schedule()
    assert [r.block_hash for r in plan.disk_retains] == first.block_hashes[:2]
    assert {r.retain_until for r in plan.disk_retains} == {clock.now + 60.0}
    s.update(result_for(plan))
    hypothesis.kv_retention_s = 0.0
    assert retain_sequence(s.blocks, s.offload, hypothesis) == 0.0
    s.check_integrity()
    assert s.blocks.num_free_blocks == 40
