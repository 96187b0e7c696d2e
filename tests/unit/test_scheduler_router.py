"""The gateway's choice among several schedulers: prefix overlap against load
(services/gateway/scheduler_router.py)."""

import pytest

from services.gateway.scheduler_router import (
    PrefixTracker,
    RouterConfig,
    SchedulerRouter,
    prompt_block_hashes,
)

BLOCK = 4


def hashes(tokens, salt="", lora=""):
    return prompt_block_hashes(tokens, BLOCK, salt, lora)


SHARED = list(range(100, 116))  # 4 full blocks


def test_block_hashes_cover_full_blocks_chain_and_respect_salt_and_adapter():
    assert hashes([1, 2, 3]) == []
    full = hashes(SHARED + [7, 8])  # the partial last block has no hash
    assert len(full) == 4 and len(set(full)) == 4
    assert hashes(SHARED[:8]) == full[:2]  # a prefix's chain is the chain's prefix
    other_tail = hashes(SHARED[:4] + [0] * 12)
    assert other_tail[0] == full[0] and other_tail[1] != full[1]
    assert hashes(SHARED, salt="tenant")[0] != full[0]
    assert hashes(SHARED, lora="sql")[0] != full[0]
    assert prompt_block_hashes(SHARED, 8) == prompt_block_hashes(SHARED, 8)
    assert prompt_block_hashes(SHARED, 8)[0] != full[0]  # block size matters


def test_longest_overlap_wins_when_load_is_close():
    router = SchedulerRouter(RouterConfig(balance_abs_threshold=2))
    first = router.choose(hashes(SHARED), {"a": 0, "b": 0})
    assert first.overlap_blocks == 0 and not first.overridden
    other = "b" if first.scheduler == "a" else "a"
    # Same prefix, different tail: goes where the prefix went, even somewhat busier.
    route = router.choose(hashes(SHARED + [1, 2, 3, 4]), {first.scheduler: 2, other: 0})
    assert route.scheduler == first.scheduler and route.overlap_blocks == 4
    assert not route.overridden
    # Longer overlap beats shorter: the other scheduler knows only the first block.
    router.tracker.record(other, hashes(SHARED)[:1])
    route = router.choose(hashes(SHARED), {first.scheduler: 1, other: 0})
    assert route.scheduler == first.scheduler


def test_load_beyond_both_thresholds_overrides_overlap():
    router = SchedulerRouter(RouterConfig(balance_abs_threshold=4, balance_rel_threshold=2.0))
    router.tracker.record("a", hashes(SHARED))
    # 5 more than b, but not twice b's load: overlap still wins.
    assert router.choose(hashes(SHARED), {"a": 11, "b": 6}).scheduler == "a"
    # Twice b's load but only 4 more: overlap still wins.
    assert router.choose(hashes(SHARED), {"a": 8, "b": 4}).scheduler == "a"
    # Both exceeded: the least loaded gets it, and now knows the prefix too.
    route = router.choose(hashes(SHARED), {"a": 9, "b": 4})
    assert route.scheduler == "b" and route.overridden and route.overlap_blocks == 0
    assert router.tracker.overlap("b", hashes(SHARED)) == 4


def test_override_prefers_overlap_among_the_least_loaded():
    router = SchedulerRouter(RouterConfig(balance_abs_threshold=0, balance_rel_threshold=1.0))
    router.tracker.record("a", hashes(SHARED))
    router.tracker.record("c", hashes(SHARED)[:2])
    route = router.choose(hashes(SHARED), {"a": 5, "b": 1, "c": 1})
    assert route.scheduler == "c" and route.overridden and route.overlap_blocks == 2


def test_ties_go_to_the_least_loaded_then_take_turns():
    router = SchedulerRouter(RouterConfig())
    assert router.choose([], {"a": 3, "b": 1, "c": 2}).scheduler == "b"
    router.tracker.record("a", hashes(SHARED)[:2])
    router.tracker.record("b", hashes(SHARED)[:2])
    assert router.choose(hashes(SHARED), {"a": 2, "b": 1}).scheduler == "b"
    picks = [router.choose(hashes([i] * 3), {"a": 0, "b": 0, "c": 0}).scheduler for i in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]
    assert picks[:3] != [picks[0]] * 3


def test_only_candidates_are_chosen_and_none_means_no_route():
    router = SchedulerRouter(RouterConfig())
    router.tracker.record("dead", hashes(SHARED))
    # "dead" is left out of the candidates (unhealthy or draining): never chosen.
    for _ in range(3):
        assert router.choose(hashes(SHARED), {"alive": 7}).scheduler == "alive"
    assert router.choose(hashes(SHARED), {}) is None
    router.forget("dead")
    assert router.tracker.size("dead") == 0
    assert router.tracker.overlap("dead", hashes(SHARED)) == 0


def test_tracker_is_a_bounded_lru_per_scheduler():
    tracker = PrefixTracker(max_blocks=4)
    chain = hashes(list(range(24)))  # 6 blocks
    tracker.record("a", chain[:4])
    assert tracker.overlap("a", chain) == 4 and tracker.size("a") == 4
    tracker.record("a", chain[:1])  # block 0 used again: most recent now
    tracker.record("a", chain[4:6])  # two more: the two least recent (1, 2) go
    assert tracker.size("a") == 4
    assert tracker.overlap("a", chain) == 1  # the chain breaks at evicted block 1
    assert tracker.overlap("a", chain[3:]) == 3
    assert tracker.size("b") == 0 and tracker.overlap("b", chain) == 0  # per scheduler
    tracker.record("b", chain)
    assert tracker.size("b") == 4 and tracker.size("a") == 4
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixTracker(0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"balance_abs_threshold": -1}, "balance_abs_threshold must be >= 0"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold must be >= 1.0"),
        ({"balance_rel_threshold": float("nan")}, "balance_rel_threshold must be >= 1.0"),
        ({"max_tracked_blocks": 0}, "max_tracked_blocks must be >= 1"),
    ],
)
def test_config_refuses_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)
