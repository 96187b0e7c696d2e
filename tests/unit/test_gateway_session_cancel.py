"""The gateway's scheduler session when a client goes away while its submit is being written
(issue 40): the request is aborted on the scheduler and forgotten by the session, and the
session goes on serving (gRPC cancels a whole stream when a write on it is cancelled: one
client's cancel must never break the stream every other request shares). The scheduler
here is a real gRPC server in this process that records what the session sends (its
Session stream only)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.scheduler_session import SchedulerSession

pytestmark = pytest.mark.timeout(30)


class RecordingScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Records each SessionRequest; answers nothing."""

    def __init__(self) -> None:
        self.messages: list[scheduler_pb2.SessionRequest] = []

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            self.messages.append(message)
        if False:  # a stream-stream handler: an async generator that yields nothing
            yield

    def actions(self, request_id: str) -> list[str]:
        out = []
        for m in self.messages:
            action = m.WhichOneof("action")
            if getattr(m, action).request_id == request_id:
                out.append(action)
        return out


def submit(request_id: str) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=[1, 2, 3])


async def until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


def test_a_submit_cancelled_while_written_is_aborted_and_forgotten():
    async def main():
        server = grpc.aio.server()
        recorder = RecordingScheduler()
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(recorder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        session = SchedulerSession(scheduler_pb2_grpc.SchedulerServiceStub(channel))
        try:
            await session.submit(submit("first"))  # the stream is open
            await until(lambda: recorder.actions("first") == ["submit"])
            # The client goes away while its submit is being written: the task is
            # suspended inside the write when it is cancelled.
            task = asyncio.ensure_future(session.submit(submit("gone")))
            await asyncio.sleep(0)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: "abort" in recorder.actions("gone"))
            assert recorder.actions("gone")[-1] == "abort"  # after its submit, if that went
            assert session.num_open == 1  # "first" only: "gone" is forgotten
            # A sample's abort (a stop string) whose client goes away during the write.
            first = session._open["first"]
            task = asyncio.ensure_future(first.abort(0))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: recorder.actions("first") == ["submit", "abort"])
            assert session.num_open == 1  # not broken: "first" still streams
            await session.submit(submit("after"))  # the session goes on
            await until(lambda: recorder.actions("after") == ["submit"])
        finally:
            await session.close()
            await channel.close()
            await server.stop(None)

    asyncio.run(main())
