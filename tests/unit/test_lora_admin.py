"""Run-time LoRA adapters in the scheduler: the registry's states (pure), and loads and
unloads carried out by `LoraAdmin` on an Engine over fake workers: all or none across
workers, a failed worker brought in line when it rejoins, an unload that refuses new
requests at once and waits for the running ones, and no prefix-cache sharing between two
adapters loaded under one name. Fake workers record a plan error whenever a step names an
adapter they do not hold, so an unload that did not wait, or a rejoin that skipped the
adapter, fails `assert_clean`."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.lora_admin import LoraAdmin
from services.scheduler.lora_registry import (
    LoraConflictError,
    LoraNotFoundError,
    LoraRegistry,
)
from services.scheduler.request import Request
from services.scheduler.worker_types import LoraRefusedError
from tests.engine_cluster import (
    assert_clean,
    assert_exact,
    cluster,
    collect,
    prompt,
    run,
    until,
)
from tests.fake_worker import worker_info

pytestmark = pytest.mark.timeout(30)


def test_registry_states_and_cache_keys():
    registry = LoraRegistry(["b", "a"])
    assert registry.names == ("a", "b") and registry.cache_key("a") == "a"
    assert registry.cache_key("") == ""
    with pytest.raises(LoraNotFoundError, match="'c'.*loaded: a, b"):
        registry.cache_key("c")
    entry = registry.begin_load("c", "/adapters/c")
    with pytest.raises(LoraNotFoundError):  # not served until every worker holds it
        registry.entry("c")
    with pytest.raises(LoraConflictError, match="being loaded"):
        registry.begin_load("c", "/elsewhere")
    with pytest.raises(LoraConflictError, match="already loaded"):
        registry.begin_load("a", "/elsewhere")
    registry.finish_load(entry, loaded=True)
    first_key = registry.cache_key("c")
    assert registry.entry("c").source == "runtime" and first_key not in ("c", "a")
    registry.begin_unload("c")
    with pytest.raises(LoraNotFoundError, match="being unloaded"):
        registry.entry("c")
    with pytest.raises(LoraConflictError, match="being unloaded"):
        registry.begin_load("c", "/adapters/c")
    registry.finish_unload("c")
    failed = registry.begin_load("c", "/adapters/c2")
    registry.finish_load(failed, loaded=False)
    assert registry.names == ("a", "b")
    registry.finish_load(registry.begin_load("c", "/adapters/c2"), loaded=True)
    assert registry.cache_key("c") != first_key  # a new adapter under the old name
    registry.begin_unload("a")  # start-time adapters may be unloaded too
    registry.finish_unload("a")
    assert registry.names == ("b", "c")


def lora_info(worker_id: str, role: str, adapters=("s",)):
    import dataclasses

    info = worker_info(worker_id, role)
    return dataclasses.replace(info, model=dataclasses.replace(info.model, lora_adapters=adapters))


def submit(c, rid: str, prompt_ids, max_tokens: int, lora_name: str):
    request = Request(rid, list(prompt_ids), max_tokens, lora_name=lora_name)
    (handle,) = c.engine.submit([request])
    return handle


def test_a_load_is_all_or_none_and_a_rejoining_worker_gets_it():
    async def scenario():
        async with cluster(lora_info("p", "prefill"), lora_info("d", "decode")) as c:
            c.engine.loras = LoraRegistry(["s"])
            admin = LoraAdmin(c.engine)
            c.worker("d").refuse_lora = "rank 99 > max_lora_rank 16"
            with pytest.raises(LoraRefusedError, match="rank 99"):
                await admin.load("x", "/adapters/x")
            assert "x" not in c.worker("p").lora_adapters  # undone where it had loaded
            with pytest.raises(LoraNotFoundError):
                submit(c, "r0", prompt(0, 9), 4, "x")
            c.worker("d").refuse_lora = None
            c.worker("d").kill()  # a failed worker does not stop the load...
            await until(lambda: not c.pool("d").healthy)
            await admin.load("x", "/adapters/x")
            assert c.engine.loras.names == ("s", "x")
            c.worker("d").revive()  # ...and holds it again before its first step
            await until(lambda: c.pool("d").healthy)
            assert c.worker("d").lora_adapters == {"s": "", "x": "/adapters/x"}
            p = prompt(1, 11)
            assert_exact(await collect(submit(c, "r1", p, 6, "x").events), p, 6)
            await assert_clean(c)

    run(scenario())


def test_an_unload_refuses_new_requests_and_waits_for_the_running_ones():
    async def scenario():
        async with cluster(lora_info("w", "both")) as c:
            c.engine.loras = LoraRegistry(["s"])
            admin = LoraAdmin(c.engine)
            await admin.load("x", "/adapters/x")
            p = prompt(2, 10)
            first = await collect(submit(c, "warm", p, 3, "x").events)
            assert first.first_cached_tokens == 0
            c.worker("w").step_delay_s = 0.01
            running = submit(c, "long", p, 30, "x")
            await until(lambda: c.engine.requests_using("x") == 1)
            unload = asyncio.ensure_future(admin.unload("x"))
            await until(lambda: "x" not in c.engine.loras.names)
            with pytest.raises(LoraNotFoundError, match="being unloaded"):
                submit(c, "late", p, 3, "x")
            await asyncio.sleep(0.05)
            assert not unload.done() and "x" in c.worker("w").lora_adapters
            assert_exact(await collect(running.events), p, 30)
            await asyncio.wait_for(unload, 5)
            assert "x" not in c.worker("w").lora_adapters
            c.worker("w").step_delay_s = 0.0
            # Loaded again under the same name: its own cache, not the old adapter's blocks.
            await admin.load("x", "/adapters/x-v2")
            again = await collect(submit(c, "again", p, 3, "x").events)
            assert again.first_cached_tokens == 0
            base = await collect(submit(c, "base", p, 3, "").events)
            assert base.first_cached_tokens == 0  # and never the base model's
            with pytest.raises(LoraNotFoundError):
                await admin.unload("nope")
            await assert_clean(c)

    run(scenario())
