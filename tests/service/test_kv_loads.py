"""KV loads ride in a real decode worker's step plans (issue 45): over real gRPC, a real
`WorkerServicer` with a loaded `Worker` and the scheduler's `WorkerClient`, the sending
half a second real `Worker` over UCX.

- A plan's load receives the sender's blocks bit for bit, and its outcome comes back with
  a step result; an `await_kv` plan (nothing else runs) is answered only once the load
  ended, not before.
- An `await_kv` plan is answered as soon as the next plan arrives, even though its load
  still waits; a load whose tag a plan cancels reports that it was cancelled and writes
  nothing; bad block ids fail that load alone, named, and the stream serves on.
"""

from __future__ import annotations

import asyncio

import grpc
import torch

from common.pb.tandem.internal.v1 import worker_pb2_grpc
from common.step_plan import KvLoad
from services.scheduler.step_plan import PoolStepPlan
from services.scheduler.worker_client import WorkerClient
from services.worker.config import WorkerConfig
from services.worker.server import WorkerServicer
from services.worker.worker import Worker


async def _decode_worker(model) -> tuple[grpc.aio.Server, WorkerServicer, WorkerClient]:
    servicer = WorkerServicer()
    servicer.worker = await Worker.load(
        WorkerConfig(model=str(model), role="decode", num_blocks=32, port=0), "kv-loads-decode"
    )
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    await client.open_step_stream()
    return server, servicer, client


def _plan(loads=(), cancelled=(), await_kv=False) -> PoolStepPlan:
    return PoolStepPlan(
        kv_loads=list(loads), cancelled_transfer_tags=list(cancelled), await_kv=await_kv
    )


def test_a_load_in_a_plan_arrives_bit_identical_and_ends_with_a_step_result(tiny_llama_dir):
    async def scenario():
        server, servicer, client = await _decode_worker(tiny_llama_dir)
        decode = servicer.worker
        sender = await Worker.load(
            WorkerConfig(model=str(tiny_llama_dir), role="prefill", num_blocks=32, port=0),
            "kv-loads-prefill",
        )
        try:
            raw = sender.kv_cache.data.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
            before = decode.kv_cache.gather_blocks([0, 3]).clone()
            src, dst, tag = [7, 2, 9], [4, 5, 1], 0xA11
            await client.send_step(_plan([KvLoad(tag, dst)], await_kv=True))
            result = asyncio.ensure_future(client.receive_step())
            await asyncio.sleep(0.3)
            assert not result.done()  # nothing ended: the await plan is not answered
            sent = await sender.peer_kv.send(
                tag, "kv-loads-decode", decode.peer_kv.transport.address, src
            )
            (done,) = (await result).kv_loads_done
            assert (done.tag, done.error, done.num_bytes) == (tag, "", sent)
            assert torch.equal(
                decode.kv_cache.gather_blocks(dst), sender.kv_cache.gather_blocks(src)
            )
            assert torch.equal(decode.kv_cache.gather_blocks([0, 3]), before)  # untouched

            # No sender for this one: the await plan is answered when the next plan arrives,
            # and the load goes on; cancelled, it reports so and writes nothing.
            waiting, target = 0xB22, [6, 8]
            untouched = decode.kv_cache.gather_blocks(target).clone()
            await client.send_step(_plan([KvLoad(waiting, target)], await_kv=True))
            await client.send_step(_plan(cancelled=[0xDEAD]))  # a plan about something else
            assert (await client.receive_step()).kv_loads_done == ()  # answered, none ended
            assert (await client.receive_step()).kv_loads_done == ()
            assert decode.peer_kv.receiving  # still under way
            await client.send_step(_plan(cancelled=[waiting], await_kv=True))
            (cancelled,) = (await client.receive_step()).kv_loads_done
            assert cancelled.tag == waiting and "cancelled" in cancelled.error
            assert torch.equal(decode.kv_cache.gather_blocks(target), untouched)

            # Block ids outside the pool fail that load alone, named; the stream serves on.
            await client.send_step(_plan([KvLoad(0xC33, [32, 1])], await_kv=True))
            (bad,) = (await client.receive_step()).kv_loads_done
            assert bad.tag == 0xC33 and "outside the pool of 32" in bad.error
            await client.send_step(_plan(cancelled=[1]))
            assert (await client.receive_step()).kv_loads_done == ()
        finally:
            await client.close()
            await server.stop(0)
            await sender.close()
            await decode.close()

    asyncio.run(scenario())
