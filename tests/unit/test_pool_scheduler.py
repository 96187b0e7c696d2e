"""Continuous batching in one pool: budget, chunking, decode priority, admission, prefix
hits, preemption (recompute and swap), async placeholders, drops, LoRA slots. Requests
leaving a pool with their KV are in test_pool_scheduler_handoff.py."""

from common.prefix_hash import root_hash
from common.step_result import PromptLogprobs, StepResult
from services.scheduler.block_manager import BlockManager
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.request import FinishReason, Logprob, Request, SamplingParams

ROOT = root_hash(b"salt")


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, first: int = 1) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first, first + prompt_len)),
        max_tokens=max_tokens,
        hash_root=ROOT,
    )


def sched(num_blocks=64, block_size=4, budget=32, max_seqs=8, **kwargs) -> PoolScheduler:
    return PoolScheduler(BlockManager(num_blocks, block_size), budget, max_seqs, **kwargs)


def swap_sched(swap_blocks: int = 8) -> PoolScheduler:
    """Four 4-token blocks that preempt by swapping into `swap_blocks` blocks of swap space."""
    return sched(
        num_blocks=4,
        block_size=4,
        budget=64,
        preemption_mode="swap",
        swap_blocks=BlockManager(swap_blocks, 4, enable_caching=False),
    )


def result_for(plan, token: int = 7) -> StepResult:
    """What a worker answers for a plan: `token` for every request the step samples."""
    sampled = {i.request.request_id: token for i in plan.scheduled if i.samples}
    return StepResult(step_id=0, sampled=sampled, execute_seconds=0.0)


def step(s: PoolScheduler, token: int = 7):
    """One step: plan, the worker's answer, the scheduler applies it."""
    plan = s.schedule()
    if not plan.is_empty:
        s.update(result_for(plan, token))
    s.check_integrity()
    return plan


def scheduled(plan):
    return [(i.request.request_id, i.num_new_tokens) for i in plan.scheduled]


def arrived(s: PoolScheduler, rid: str, prompt_len: int, max_tokens: int = 50, first: int = 1):
    """A request that reaches a decode pool with its KV (first token sampled elsewhere)."""
    r = make_request(rid, prompt_len, max_tokens=max_tokens, first=first)
    r.append_token(5)
    r.num_computed_tokens = r.num_tokens - 1
    s.blocks.allocate(rid, r.num_computed_tokens)
    s.add(r)
    return r


def test_prompt_is_chunked_under_the_token_budget_and_blocks_grow_with_it():
    s = sched(budget=6)
    r = make_request("a", 14)
    s.add(r)
    plan = step(s)
    (item,) = plan.scheduled
    assert (item.is_new, item.num_new_tokens, item.num_computed_before) == (True, 6, 0)
    assert item.new_block_ids == s.blocks.table("a") and len(item.new_block_ids) == 2
    plan = step(s)
    (item,) = plan.scheduled
    assert (item.is_new, item.num_new_tokens, item.num_computed_before) == (False, 6, 6)
    assert len(item.new_block_ids) == 1  # tokens 6..11 need block 2 only
    assert r.output_token_ids == []  # no sample before the last chunk
    plan = step(s)
    assert scheduled(plan) == [("a", 2)]
    assert r.output_token_ids == [7]
    assert scheduled(step(s)) == [("a", 1)]  # now decoding


def test_running_requests_go_first_and_waiting_ones_join_in_order():
    s = sched(budget=10)
    for rid, first in (("a", 100), ("b", 200), ("c", 300)):
        s.add(make_request(rid, 8, first=first))
    assert scheduled(step(s)) == [("a", 8), ("b", 2)]
    # a decodes (1), b finishes its prompt (6), c starts with what is left (3).
    assert scheduled(step(s)) == [("a", 1), ("b", 6), ("c", 3)]


def test_a_long_prompt_chunk_never_starves_later_decodes():
    s = sched(budget=8)
    decoders = [make_request(f"d{i}", 2, max_tokens=50, first=100 * (i + 1)) for i in range(3)]
    for d in decoders:
        s.add(d)
    step(s)  # the three short prompts
    long = make_request("long", 40, first=500)
    s.add(long)
    for _ in range(5):
        got = dict(scheduled(step(s)))
        # Every decode gets its token; the prompt chunks with what is left.
        assert all(got[d.request_id] == 1 for d in decoders)
        assert got["long"] == 8 - 3
    # Older prompt chunks ahead of decodes also leave one token per decode behind them.
    s2 = sched(budget=8)
    long2 = make_request("long", 40, first=500)
    s2.add(long2)
    step(s2)
    d = make_request("d", 2, first=900)
    s2.running.append(d)  # as if admitted earlier and now decoding
    d.num_computed_tokens, d.output_token_ids = 2, [5]
    s2.blocks.allocate("d", 2)
    assert dict(scheduled(s2.schedule())) == {"long": 7, "d": 1}


def test_max_num_seqs_caps_the_running_batch():
    s = sched(max_seqs=2)
    for i in range(3):
        s.add(make_request(str(i), 2, first=10 * i + 1))
    plan = step(s)
    assert len(plan.scheduled) == 2
    assert len(s.waiting) == 1


def test_finished_request_is_released_and_dropped_on_the_next_plan():
    s = sched()
    r = make_request("a", 3, max_tokens=1)
    s.add(r)
    step(s)
    assert r.finish_reason is FinishReason.LENGTH
    assert s.blocks.num_requests == 0
    plan = s.schedule()
    assert plan.dropped_request_ids == ["a"] and not plan.scheduled
    assert s.schedule().dropped_request_ids == []


def test_prefix_hit_skips_cached_blocks_but_always_recomputes_the_last_token():
    s = sched(num_blocks=16, block_size=4)
    first = make_request("first", 8, max_tokens=1)  # exactly two full blocks
    s.add(first)
    step(s)
    assert first.num_cached_tokens == 0
    # Same 8-token prompt: block 1 holds the last token, which must be computed, so only
    # block 0 can come from the cache.
    again = make_request("again", 8, max_tokens=1)
    s.add(again)
    plan = step(s)
    (item,) = plan.scheduled
    assert (item.num_computed_before, item.num_new_tokens) == (4, 4)
    assert again.num_cached_tokens == 4
    # A longer prompt sharing both blocks reuses both.
    longer = make_request("longer", 11, max_tokens=1)
    s.add(longer)
    (item,) = step(s).scheduled
    assert (item.num_computed_before, item.num_new_tokens) == (8, 3)
    assert longer.num_cached_tokens == 8
    assert s.num_prefix_hit_tokens == 12
    # Queries (vLLM's prefix_cache_queries, in tokens): each prompt once, when admitted.
    assert s.num_prefix_query_tokens == 8 + 8 + 11
    assert first.first_scheduled_time <= again.first_scheduled_time <= longer.first_scheduled_time


def test_newest_running_request_is_preempted_for_recompute_when_blocks_run_out():
    s = sched(num_blocks=4, block_size=4, budget=64)
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 7, max_tokens=20, first=50)
    s.add(a)
    s.add(b)
    step(s)  # a: 2 blocks (8 tokens), b: 2 blocks (7 tokens); pool full
    assert s.blocks.num_free_blocks == 0
    plan = step(s)
    # a needs a third block for its 9th token: b (newest) is preempted, a runs.
    assert [p.request_id for p in plan.preempted] == ["b"]
    assert scheduled(plan) == [("a", 1)]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert plan.dropped_request_ids == ["b"]
    assert not s.holds(b)  # the caller re-queues it
    s.check_integrity()


def test_lone_request_that_cannot_grow_preempts_itself():
    s = sched(num_blocks=2, block_size=4, budget=64)
    a = make_request("a", 8, max_tokens=4)
    s.add(a)
    step(s)
    plan = step(s)
    assert plan.preempted == [a] and not plan.scheduled
    assert s.blocks.num_free_blocks == 2


def test_swap_preemption_moves_kv_out_and_back_keeping_progress():
    s = swap_sched()
    # a grows to 8 + 8 tokens = all 4 blocks; b (7 + 3 tokens) must make room.
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 7, max_tokens=3, first=50)
    s.add(a)
    s.add(b)
    step(s)
    b_blocks = s.blocks.table("b")
    plan = step(s)
    assert plan.swapped_out == [b] and not plan.preempted
    assert [src for src, _ in plan.swap_out] == b_blocks
    assert b.num_computed_tokens == 7 and s.swapped[0] is b  # progress kept
    assert s.swap_blocks.num_free_blocks == 6
    plan = step(s)
    while not plan.swap_in:  # a runs alone until it finishes and frees its blocks
        assert scheduled(plan) == [("a", 1)]
        plan = step(s)
    assert a.is_finished and len(a.output_token_ids) == 8
    # b is back, continuing from its 8th token (no recompute of its prompt).
    assert [src for src, _ in plan.swap_in] == [0, 1]  # the swap blocks it was given
    assert [dst for _, dst in plan.swap_in] == s.blocks.table("b")[:2]
    (item,) = plan.scheduled
    assert item.request is b and item.is_new
    assert (item.num_computed_before, item.num_new_tokens) == (7, 1)
    assert s.swap_blocks.num_free_blocks == 8
    while not b.is_finished:
        step(s)
    assert b.output_token_ids == [7, 7, 7]
    s.check_integrity()


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    s = swap_sched(swap_blocks=1)
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 7, max_tokens=20, first=50)
    s.add(a)
    s.add(b)
    step(s)
    plan = step(s)
    assert plan.preempted == [b] and not plan.swapped_out  # b needs 2 swap blocks, 1 exist


def test_waiting_requests_holding_blocks_yield_only_when_nothing_runs():
    # Decode-pool situation: requests arrive with received KV already in blocks.
    s = sched(num_blocks=4, block_size=4, budget=64)
    a, b = make_request("a", 8), make_request("b", 8, first=50)
    for r in (a, b):
        r.append_token(5)  # first token came from the prefill worker
        r.num_computed_tokens = r.num_tokens - 1
        s.blocks.allocate(r.request_id, r.num_computed_tokens)
        s.add(r)
    assert s.blocks.num_free_blocks == 0
    plan = s.schedule()
    # a needs a third block for its 9th token and nothing runs: b gives its blocks up.
    assert plan.preempted == [b]
    assert scheduled(plan) == [("a", 1)]


def test_head_that_cannot_start_does_not_preempt_requests_without_blocks():
    # Prefill-pool situation: blocks are held outside the queues (requests handed off to
    # decode); waiting requests hold none, so preempting them would free nothing.
    s = sched(num_blocks=2, block_size=4, budget=64)
    s.blocks.allocate("handed-off", 8)
    for i in range(3):
        s.add(make_request(str(i), 4, first=10 * i + 1))
    plan = s.schedule()
    assert plan.is_empty and not plan.preempted
    assert len(s.waiting) == 3


def test_async_placeholders_schedule_the_token_still_in_flight():
    s = sched(budget=32)
    r = make_request("a", 5, max_tokens=10)
    s.add(r)
    first = s.schedule()  # prompt; samples token 1 (pending)
    assert r.num_pending_tokens == 1
    second = s.schedule()  # before the result: the worker computes its own token
    assert scheduled(second) == [("a", 1)] and r.num_pending_tokens == 2
    s.update(result_for(first))
    s.update(result_for(second))
    assert r.output_token_ids == [7, 7] and r.num_pending_tokens == 0


def test_prefill_only_pool_never_schedules_past_the_prompt():
    s = sched(budget=32, runs_decodes=False)
    r = make_request("a", 5)
    s.add(r)
    s.schedule()
    assert r.num_pending_tokens == 1
    assert s.schedule().scheduled == []  # the decode pool takes it from here


def test_no_placeholder_step_once_the_pending_tokens_reach_max_tokens():
    s = sched(budget=32)
    r = make_request("a", 5, max_tokens=1)
    s.add(r)
    s.schedule()
    assert s.schedule().scheduled == []  # its only token is already being sampled


def test_preempted_request_with_a_token_on_the_way_waits_for_it():
    s = sched(budget=32)
    r = make_request("a", 5, max_tokens=10)
    r.num_pending_tokens = 1  # preempted while its token was in flight
    s.add(r)
    assert s.schedule().scheduled == []
    r.num_pending_tokens = 0
    r.append_token(9)
    assert scheduled(s.schedule()) == [("a", 6)]  # recomputes prompt + token 9


def test_request_finishes_on_stop_token_and_max_tokens():
    r = Request("a", [1, 2], max_tokens=3, stop_token_ids=frozenset({9}))
    assert r.append_token(4) is None
    assert r.append_token(9) is FinishReason.STOP
    r2 = Request("b", [1], max_tokens=2)
    r2.append_token(1)
    assert r2.append_token(1) is FinishReason.LENGTH
    r3 = Request("c", [1, 2, 3], max_tokens=10, max_model_len=4)
    assert r3.append_token(1) is FinishReason.LENGTH


def test_ends_at_its_next_token_by_max_tokens_or_the_context():
    assert Request("a", [1, 2, 3], max_tokens=1).ends_at_its_next_token
    assert not Request("b", [1, 2, 3], max_tokens=2).ends_at_its_next_token
    assert Request("c", [1, 2, 3], max_tokens=10, max_model_len=4).ends_at_its_next_token
    assert not Request("d", [1, 2, 3], max_tokens=10, max_model_len=5).ends_at_its_next_token
    r = Request("e", [1, 2, 3], max_tokens=3)
    r.append_token(7)
    assert not r.ends_at_its_next_token  # recomputed after a preemption: one more to go
    r.append_token(8)
    assert r.ends_at_its_next_token


def test_context_limit_counts_only_tokens_that_arrived():
    r = Request("a", [1, 2, 3], max_tokens=10, max_model_len=5)
    r.num_pending_tokens = 2  # two samples in flight
    r.num_pending_tokens -= 1
    assert r.append_token(4) is None  # 4 known tokens < 5, although 5 are in sight
    assert r.will_finish
    r.num_pending_tokens -= 1
    assert r.append_token(5) is FinishReason.LENGTH


def samples_of(prompt_len: int, n: int) -> list[Request]:
    group = [make_request(f"s/{i}", prompt_len) for i in range(n)]
    for sample in group[1:]:
        sample.prompt_of = group[0].request_id
    return group


def test_samples_wait_for_their_leaders_prompt_blocks_then_share_them():
    # A 14-token prompt has 3 full 4-token blocks before its last token; a 6-token budget
    # chunks the leader over three steps, and the other samples start only then.
    s = sched(budget=6)
    group = samples_of(14, 3)
    for sample in group:
        s.add(sample)
    assert scheduled(step(s)) == [("s/0", 6)]
    assert scheduled(step(s)) == [("s/0", 6)]  # 12 planned: every full block
    plan = step(s)
    assert scheduled(plan) == [("s/0", 2), ("s/1", 2), ("s/2", 2)]
    leader_table = s.blocks.table("s/0")
    for follower in ("s/1", "s/2"):
        table = s.blocks.table(follower)
        assert table[:3] == leader_table[:3] and table[3] != leader_table[3]
    assert [r.num_cached_tokens for r in group] == [0, 12, 12]
    for sample in group:
        s.release(sample)
    s.check_integrity()
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_samples_do_not_wait_without_prefix_caching():
    s = PoolScheduler(BlockManager(64, 4, enable_caching=False), 32, 8)
    for sample in samples_of(14, 2):
        s.add(sample)
    assert scheduled(step(s)) == [("s/0", 14), ("s/1", 14)]


def test_update_appends_tokens_finishes_and_releases_in_one_place():
    s = sched(budget=32)
    a, b = make_request("a", 5, max_tokens=2), make_request("b", 3, max_tokens=5)
    a.stop_token_ids = frozenset({99})
    for r in (a, b):
        s.add(r)
    plan = s.schedule()
    update = s.update(StepResult(step_id=1, sampled={"a": 11, "b": 99}, execute_seconds=0.0))
    assert [(t.request.request_id, t.token_id, t.finish_reason) for t in update.tokens] == [
        ("a", 11, None),
        ("b", 99, None),  # 99 stops only a
    ]
    assert update.finished == [] and plan.scheduled[0].samples
    update = s.update(result_for(s.schedule(), token=99))
    assert [t.finish_reason for t in update.tokens] == [FinishReason.STOP, None]
    assert update.finished == [a] and not s.holds(a) and not s.blocks.has("a")
    assert s.schedule().dropped_request_ids == ["a"]
    s.check_integrity()


def test_update_hands_done_prompts_of_a_prefill_pool_over_with_their_blocks():
    s = sched(budget=32, runs_decodes=False)
    r = make_request("a", 6)
    s.add(r)
    update = s.update(result_for(s.schedule()))
    assert update.ready_for_handoff == [r] and r.output_token_ids == [7]
    assert not s.holds(r) and s.blocks.has("a")  # out of the queues, blocks kept
    assert s.schedule().dropped_request_ids == ["a"]  # the worker forgets it


def test_update_drops_tokens_of_requests_finished_while_the_step_ran():
    s = sched(budget=32)
    r = make_request("a", 4)
    s.add(r)
    plan = s.schedule()
    r.finish_reason = FinishReason.ABORT  # aborted meanwhile
    s.release(r)
    update = s.update(result_for(plan))
    assert update.tokens == [] and r.output_token_ids == []


def test_update_gathers_prompt_logprobs_and_sends_them_with_the_first_token():
    s = sched(budget=4)
    r = make_request("a", 6)
    r.sampling = SamplingParams(prompt_logprobs=0)
    s.add(r)
    s.schedule()  # chunk 0..3
    first = [Logprob(t, -1.0) for t in (2, 3, 4)]  # positions 1..3
    u = s.update(
        StepResult(
            step_id=1,
            sampled={},
            execute_seconds=0.0,
            prompt_logprobs={"a": PromptLogprobs(1, tuple(first))},
        )
    )
    assert u.tokens == [] and r.prompt_logprobs == first
    s.schedule()
    rest = [Logprob(t, -2.0) for t in (5, 6)]
    u = s.update(
        StepResult(
            step_id=2,
            sampled={"a": 8},
            execute_seconds=0.0,
            prompt_logprobs={"a": PromptLogprobs(4, tuple(rest))},
        )
    )
    (token,) = u.tokens
    assert token.prompt_logprobs == first + rest and r.prompt_logprobs_sent


def test_update_ignores_a_token_for_a_request_that_started_over():
    s = sched(budget=32)
    r = make_request("a", 4)
    s.add(r)
    plan = s.schedule()
    r.num_pending_tokens = 0  # its worker failed; the request starts over elsewhere
    update = s.update(result_for(plan))
    assert update.unexpected == ["a"] and r.output_token_ids == []


def test_prompt_tokens_computed_counts_prompts_and_recomputes_not_arrived_kv():
    s = sched(budget=8)
    r = make_request("a", 10, max_tokens=3)
    s.add(r)
    while not r.is_finished:  # chunks of 8 and 2, then decodes
        step(s)
    assert s.num_prompt_tokens_computed == 10
    restarted = make_request("b", 4, max_tokens=9, first=100)
    restarted.output_token_ids = [3, 3, 3]  # recomputes positions 0..5; 6 is the last token
    s.add(restarted)
    step(s)
    assert s.num_prompt_tokens_computed == 10 + 6
    other = sched()  # a decode pool: the KV arrives with the request
    arrived(other, "m", 10)
    step(other)
    step(other)
    assert other.num_prompt_tokens_computed == 0


def test_running_requests_use_at_most_max_loras_adapters_and_the_rest_wait():
    """Two LoRA slots: requests of a third adapter wait (base-model and same-adapter
    requests join) until an adapter's last request finishes."""
    s = sched(max_loras=2)
    adapters = ["a", "b", "c", None, "a"]
    for i, name in enumerate(adapters):
        request = make_request(f"r{i}", 4, max_tokens=2, first=10 * i + 1)
        request.lora_name = name or ""
        s.add(request)
    plan = step(s)
    assert [r for r, _ in scheduled(plan)] == ["r0", "r1", "r3", "r4"]  # r2 ("c") waits
    assert {r.lora_name for r in s.running if r.lora_name} == {"a", "b"}
    while "r2" not in [r for r, _ in scheduled(plan)]:
        plan = step(s)
        assert len({r.lora_name for r in s.running if r.lora_name}) <= 2
    assert all(r.request_id != "r1" for r in s.running)  # "b" finished first, then "c" ran
