"""Which scheduler the gateway may pick (services/gateway/schedulers.py), without a stack:
one scheduler is always taken (today's path, no retry target); with several, only healthy
ones that serve the request's adapter, never one already tried; a broken session takes its
scheduler out at once; the served model merges the healthy schedulers' adapters; two
schedulers serving different models are told apart. Channels are made but never used."""

import asyncio

import grpc

from common.pb.tandem.internal.v1 import scheduler_pb2, types_pb2
from services.gateway.scheduler_router import RouterConfig
from services.gateway.scheduler_session import SchedulerError
from services.gateway.schedulers import Schedulers, model_identity

MODEL = types_pb2.ModelDescription(
    name="m", architecture="llama", vocab_size=1024, max_model_len=512, eos_token_ids=[2]
)


def with_models(schedulers: Schedulers, adapters: list[list[str]]) -> Schedulers:
    for backend, names in zip(schedulers.backends, adapters, strict=True):
        backend.model = types_pb2.ModelDescription()
        backend.model.CopyFrom(MODEL)
        backend.model.lora_adapters.extend(names)
        backend.block_size = 16
    return schedulers


def submit(lora: str = "", prompt=tuple(range(40))) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=prompt, lora_name=lora)


def test_one_scheduler_always_takes_the_request_and_never_leaves():
    async def main():
        one = with_models(Schedulers(("a:1",), None, RouterConfig()), [[]])
        try:
            assert one.single and one.router is None
            assert one.pick(submit()) is one.backends[0]
            one.backends[0].healthy = False  # its health shows in the gateway's, no more
            assert one.pick(submit("x")) is one.backends[0]
            assert one.pick(submit(), exclude=(one.backends[0],)) is None  # no retry
            one._broken(one.backends[0], SchedulerError(grpc.StatusCode.UNAVAILABLE, "gone"))
            assert one.model().lora_adapters == []
        finally:
            await one.close()

    asyncio.run(main())


def test_several_pick_only_healthy_untried_schedulers_serving_the_adapter():
    async def main():
        several = with_models(
            Schedulers(("a:1", "b:2", "c:3"), None, RouterConfig()), [["sql"], ["sql"], []]
        )
        a, b, c = several.backends
        try:
            assert not several.single
            assert several.pick(submit("sql")) in (a, b)
            assert several.pick(submit("sql"), exclude=(a,)) is b
            assert several.pick(submit("sql"), exclude=(a, b)) is None
            # The prompt's prefix now lives where it went; a broken session takes that one
            # out (and forgets what it held), so the next pick goes elsewhere.
            home = several.pick(submit())
            assert several.pick(submit()) is home
            several._broken(home, SchedulerError(grpc.StatusCode.UNAVAILABLE, "reset"))
            assert not home.healthy
            assert several.router.tracker.size(home.address) == 0
            assert all(several.pick(submit()) is not home for _ in range(4))
            # A request's own error (not the session's) leaves the scheduler in.
            other = next(x for x in several.backends if x.healthy)
            several._broken(other, SchedulerError(grpc.StatusCode.INTERNAL, "bug"))
            assert other.healthy
            for backend in several.backends:
                backend.healthy = False
            assert several.pick(submit()) is None
            c.healthy = True
            assert several.pick(submit()) is c
            assert several.model().lora_adapters == []  # only c's adapters count now
            a.healthy = True
            assert several.model().lora_adapters == ["sql"]
        finally:
            await several.close()

    asyncio.run(main())


def test_model_identity_ignores_adapters_but_not_the_model_or_block_size():
    other_adapters = types_pb2.ModelDescription()
    other_adapters.CopyFrom(MODEL)
    other_adapters.lora_adapters.append("sql")
    assert model_identity(MODEL, 16) == model_identity(other_adapters, 16)
    assert model_identity(MODEL, 16) != model_identity(MODEL, 32)
    bigger = types_pb2.ModelDescription()
    bigger.CopyFrom(MODEL)
    bigger.max_model_len = 1024
    assert model_identity(MODEL, 16) != model_identity(bigger, 16)
