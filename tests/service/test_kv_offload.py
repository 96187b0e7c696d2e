"""The host-memory KV offload tier end to end (`--kv-offload-cpu-bytes`): a conversation
whose prefix the worker's pool evicted comes back from the tier instead of being
recomputed, token for token as HF `generate`, with no block left held in either tier."""

from __future__ import annotations

import pytest

from tests.hf_reference import hf_greedy
from tests.stack_client import generate, greedy_request, pool_stats, start_stack, wait_until_idle

BLOCK = 16


def salted(prompt: list[int], max_tokens: int, salt: str = "offload"):
    request = greedy_request(prompt, max_tokens)
    request.cache_salt = salt
    return request


def tier(stack):
    """The stats of the pool with the offload tier (the one that runs prompts)."""
    (pool,) = [p for p in wait_until_idle(stack).pools if p.num_offload_cpu_blocks]
    return pool


@pytest.mark.parametrize("topology", ["both", "prefill-decode", "both-tp2"])
def test_an_evicted_conversation_prefix_is_loaded_from_the_offload_tier(
    tiny_llama_dir, tmp_path, topology
):
    """A `both` worker; a prefill worker with the tier beside a decode worker (the prompt's
    blocks it loads are then sent on as usual); a `both` worker of two tensor-parallel
    ranks (each loads and saves its own heads' slice)."""
    pool = ["--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)]
    offload = [*pool, "--kv-offload-cpu-bytes", "64MiB"]
    if topology == "prefill-decode":
        shape, args = dict(prefill=1, decode=1), {"prefill": offload, "decode": pool}
    else:
        shape, args = dict(prefill=0, decode=0, both=1), {"both": offload}
        if topology == "both-tp2":
            args["both"] = [*offload, "--tensor-parallel-size", "2"]
    stack = start_stack(tiny_llama_dir, tmp_path / "run", extra_args=args, **shape)
    try:
        address = stack.spec.gateway_address
        first = list(range(5, 69))  # 4 full blocks
        turn1 = generate(address, salted(first, 8))
        assert turn1.token_ids == hf_greedy(tiny_llama_dir, first, 8)
        before = tier(stack)
        assert before.num_offload_cpu_blocks > 20 and before.offload_saved_blocks >= 4
        # Two unrelated prompts of 8 blocks each, one after the other: the pool of 10
        # blocks evicts every block of the first turn (the oldest freed go first).
        for start in (300, 500):
            flood = list(range(start, start + 120))
            assert generate(address, salted(flood, 4)).token_ids == hf_greedy(
                tiny_llama_dir, flood, 4
            )
        flooded = tier(stack)
        assert flooded.evictions - before.evictions >= 4
        # The next turn: the first turn's prompt and answer, then a follow-up.
        second = first + list(turn1.token_ids) + list(range(80, 90))
        turn2 = generate(address, salted(second, 8))
        assert turn2.token_ids == hf_greedy(tiny_llama_dir, second, 8)
        assert turn2.usage.cached_tokens == 4 * BLOCK  # blocks 0-3, all from the tier
        after = tier(stack)
        assert after.offload_hit_tokens - flooded.offload_hit_tokens == 4 * BLOCK
        assert after.offload_loaded_blocks - flooded.offload_loaded_blocks == 4
        assert after.prefix_hit_tokens == flooded.prefix_hit_tokens  # none on the device
        # Another cache_salt shares nothing, in the tier as on the device.
        other = generate(address, salted(second, 8, salt="tenant-b"))
        assert other.usage.cached_tokens == 0 and other.token_ids == turn2.token_ids
        pools = wait_until_idle(stack).pools
        assert all(p.num_free_blocks == p.num_blocks for p in pools)  # nothing leaked
        assert tier(stack).num_offload_cpu_cached_blocks > 0
        assert sum(p.num_offload_cpu_blocks > 0 for p in pool_stats(stack).pools) == 1
    finally:
        stack.stop()
