"""The gateway's session with the scheduler: the pure batching of engine events into
updates, and a real scheduler's `Session` stream (requests submitted on one stream, their
tokens batched across requests, refusals and aborts per request, everything freed when the
stream ends)."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2
from common.sampling import Logprob
from services.scheduler.handle import Finished, Tokens
from services.scheduler.request import FinishReason
from services.scheduler.session import SessionState, updates_from_events
from tests.stack_client import wait_until_idle


def test_updates_merge_runs_of_one_sample_and_keep_requests_apart():
    events = [
        ("a", Tokens(0, [5], [Logprob(5, -0.1, ())], [], 3)),
        ("b", Tokens(0, [7])),
        ("a", Tokens(0, [6])),
        ("a", Finished(0, FinishReason.LENGTH, 4, 2, 3)),
        ("b", Tokens(1, [9])),
        ("c", Finished(0, FinishReason.ABORT, 4, 0, 0, ("UNAVAILABLE", "worker gone"))),
    ]
    updates = updates_from_events(events)
    assert [(u.request_id, u.index, list(u.token_ids)) for u in updates] == [
        ("a", 0, [5, 6]),
        ("b", 0, [7]),
        ("b", 1, [9]),
        ("c", 0, []),
    ]
    a = updates[0]
    assert a.finish_reason == generate_pb2.FINISH_REASON_LENGTH and a.usage.completion_tokens == 2
    assert a.cached_tokens == 3 and len(a.logprobs) == 1
    assert updates[3].error_code == "UNAVAILABLE" and updates[3].error_message == "worker gone"


def test_session_state_counts_finished_samples():
    state = SessionState()
    state.opened("r", [object(), object()])  # two samples
    state.sink("r").put_nowait(Finished(0, FinishReason.STOP, 1, 1, 0))
    state.refuse("x", "INVALID_ARGUMENT", "bad")
    batch = state.drain(state.queue.get_nowait())
    assert [request_id for request_id, _ in batch] == ["r", "x"]
    assert state.unfinished == {"r": 1}
    state.sink("r").put_nowait(Finished(1, FinishReason.STOP, 1, 1, 0))
    state.drain(state.queue.get_nowait())
    assert not state.unfinished and not state.handles


@pytest.fixture(scope="module")
def stack(module_stacks):
    return module_stacks(name="session")


def submit(request_id: str, max_tokens: int, n: int = 1) -> scheduler_pb2.SessionRequest:
    request = scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=list(range(10, 30)), max_tokens=max_tokens, n=n
    )
    return scheduler_pb2.SessionRequest(submit=request)


class Session:
    """A raw Session stream to the scheduler, driven from this thread."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outbox: queue.Queue = queue.Queue()
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self.call = stub.Session(iter(self.outbox.get, None), timeout=120)
        self.responses: list[scheduler_pb2.SessionResponse] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.append(response)
        except grpc.RpcError:
            pass

    def updates(self) -> list[scheduler_pb2.SubmitResponse]:
        return [u for r in list(self.responses) for u in r.updates]

    def finished(self, request_id: str, samples: int = 1) -> bool:
        done = [u for u in self.updates() if u.request_id == request_id and u.finish_reason]
        return len(done) >= samples

    def close(self) -> None:
        """Half-close: what was submitted still runs to the end."""
        self.outbox.put(None)
        self.reader.join(timeout=60)
        self.channel.close()

    def cancel(self) -> None:
        """Drop the stream (a gateway that died): the scheduler aborts what still runs."""
        self.call.cancel()
        self.reader.join(timeout=60)
        self.channel.close()


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_tokens_of_many_requests_share_messages(stack):
    session = Session(stack.spec.scheduler_address)
    ids = [f"batch-{i}" for i in range(8)]
    for request_id in ids:
        session.outbox.put(submit(request_id, 24))
    wait_for(lambda: all(session.finished(r) for r in ids))
    session.close()
    for request_id in ids:
        tokens = [t for u in session.updates() if u.request_id == request_id for t in u.token_ids]
        assert len(tokens) == 24
    # Decode steps produce one message with every running request's token, not one each.
    widest = max(len({u.request_id for u in r.updates}) for r in session.responses)
    assert widest >= 4
    assert len(session.responses) < sum(len(r.updates) for r in session.responses)
    wait_until_idle(stack)


def test_refusals_and_aborts_are_per_request(stack):
    session = Session(stack.spec.scheduler_address)
    session.outbox.put(submit("too-long", 10_000))  # beyond max_model_len
    session.outbox.put(submit("runs", 5))
    session.outbox.put(submit("stopped", 400, n=2))
    wait_for(lambda: session.finished("too-long") and session.finished("runs"))
    refused = next(u for u in session.updates() if u.request_id == "too-long")
    assert refused.error_code == "INVALID_ARGUMENT" and "max_model_len" in refused.error_message
    wait_for(lambda: any(u.request_id == "stopped" and u.token_ids for u in session.updates()))
    abort = scheduler_pb2.AbortRequest(request_id="stopped", index=1)
    session.outbox.put(scheduler_pb2.SessionRequest(abort=abort))

    def sample1_finished() -> bool:
        return any(
            u.request_id == "stopped" and u.index == 1 and u.finish_reason
            for u in session.updates()
        )

    wait_for(sample1_finished)
    sample0_done = [u for u in session.updates() if u.request_id == "stopped" and u.index == 0]
    assert not any(u.finish_reason for u in sample0_done)  # the other sample goes on
    session.cancel()  # sample 0 had ~400 tokens to go: aborted, its blocks freed
    wait_until_idle(stack)
