"""A worker that drains (SIGTERM) and comes back before the scheduler's health checks
would count it failed is still seen as a new process: its health answers carry another
boot id, so the scheduler fails it (its step stream is the old process's) and rejoins it
with a fresh stream, and the next request is served instead of failing UNAVAILABLE.
The window is made as wide as it gets (--worker-health-max-misses 100000: missed checks
alone never fail it), so only the boot id can tell; the test waits for the scheduler's
own counters, never for time to pass."""

from __future__ import annotations

import signal

from tests.fault_injection import wait_for, wait_healthy_pools
from tests.hf_reference import hf_greedy
from tests.stack_client import generate, greedy_request, pool_stats, start_stack, wait_until_idle


def test_a_worker_restarted_within_the_health_window_is_rejoined(tiny_llama_dir, tmp_path):
    args = {"scheduler": ["--worker-health-max-misses", "100000"]}
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=1, extra_args=args
    )
    address = stack.spec.gateway_address
    prompt = list(range(5, 40))
    expected = hf_greedy(tiny_llama_dir, prompt, 6)
    try:
        assert generate(address, greedy_request(prompt, 6)).token_ids == expected
        (worker,) = [p.name for p in stack.processes if p.name.startswith("both")]
        failures = pool_stats(stack).worker_failures
        stack.signal(worker, signal.SIGTERM)  # drains (idle: at once) and exits
        stack.wait_exit(worker)
        assert pool_stats(stack).worker_failures == failures  # the misses never count
        stack.restart(worker)
        wait_for(lambda: pool_stats(stack).worker_failures > failures, 60, "restart seen")
        wait_healthy_pools(stack)
        assert generate(address, greedy_request(prompt, 6)).token_ids == expected
        (pool,) = wait_until_idle(stack).pools
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        stack.stop()
