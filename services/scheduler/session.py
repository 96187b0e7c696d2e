"""A gateway's session: every request it submitted, their events in one queue, and the
batched updates that go back (`SessionResponse`: all the requests that advanced together
in one message, instead of one message per token per request).

The engine puts each request's events (`Tokens`, then one `Finished` per sample) into a
`TaggedSink`, which tags them with the client request id; the session's writer drains
everything that piled up and turns it into one message (`updates_from_events`). No grpc
here: the servicer does the I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from common.sampling_pb import logprob_to_pb
from services.scheduler.beam_driver import BeamDriver
from services.scheduler.handle import Finished, RequestHandle, Tokens
from services.scheduler.request import FinishReason

FINISH_TO_PB = {
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
}


# Put in the queue when the gateway closed its side of the session.
SESSION_CLOSED = object()


@dataclass(frozen=True)
class Refused:
    """A request refused at submit (before any sample started): (status name, message)."""

    code: str
    message: str


class TaggedSink:
    """The `events` of one client request's samples: puts (request id, event) into the
    session's queue."""

    def __init__(self, queue: asyncio.Queue, request_id: str) -> None:
        self._queue = queue
        self.request_id = request_id

    def put_nowait(self, event) -> None:
        self._queue.put_nowait((self.request_id, event))


@dataclass
class SessionState:
    """What one session has open: client request id -> its samples' handles and the
    samples not finished yet."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    handles: dict[str, list[RequestHandle]] = field(default_factory=dict)
    unfinished: dict[str, int] = field(default_factory=dict)
    # Beam searches (`beam_driver.py`), by client request id.
    searches: dict[str, BeamDriver] = field(default_factory=dict)

    def sink(self, request_id: str) -> TaggedSink:
        return TaggedSink(self.queue, request_id)

    def opened(
        self, request_id: str, handles: list[RequestHandle], outputs: int | None = None
    ) -> None:
        """`outputs`: the Finished events that end the request (default one per handle)."""
        self.handles[request_id] = handles
        self.unfinished[request_id] = len(handles) if outputs is None else outputs

    def opened_search(self, request_id: str, search: BeamDriver, outputs: int) -> None:
        """A beam search: it ends with one Finished per hypothesis returned."""
        self.searches[request_id] = search
        self.unfinished[request_id] = outputs

    def abort(self, engine, request_id: str, index: int | None) -> None:
        """The gateway stops a request (or one of its samples)."""
        search = self.searches.get(request_id)
        if search is not None:
            search.abort()  # a search's results end together
            return
        ids = self.sample_ids(request_id)
        if index is not None:
            ids = ids[index : index + 1]
        for sample_id in ids:
            engine.abort(sample_id)

    def refuse(self, request_id: str, code: str, message: str) -> None:
        self.queue.put_nowait((request_id, Refused(code, message)))

    def sample_ids(self, request_id: str) -> list[str]:
        return [h.request.request_id for h in self.handles.get(request_id, ())]

    def drain(self, first) -> list:
        """`first` and everything else already queued."""
        batch = [first]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        for request_id, event in batch:
            if isinstance(event, Finished) and request_id in self.unfinished:
                self.unfinished[request_id] -= 1
                if not self.unfinished[request_id]:
                    del self.unfinished[request_id]
                    self.handles.pop(request_id, None)
                    self.searches.pop(request_id, None)
        return batch

    def running_handles(self) -> list[RequestHandle]:
        return [h for handles in self.handles.values() for h in handles if not h.done]

    def abort_all(self, engine) -> int:
        """The gateway went away: stop everything still running; how many."""
        orphans = self.running_handles()
        for handle in orphans:
            engine.abort(handle.request.request_id)
        searches = [s for s in self.searches.values() if not s.done]
        for search in searches:
            search.abort()
        return len(orphans) + len(searches)


def updates_from_events(events: list) -> list[scheduler_pb2.SubmitResponse]:
    """One SubmitResponse per run of a sample's events (tokens merged); a Finished closes
    its sample's update; a refusal is an update of its own. `events` are (request id,
    event) pairs in the order they happened."""
    out: list[scheduler_pb2.SubmitResponse] = []
    open_updates: dict[tuple[str, int], scheduler_pb2.SubmitResponse] = {}
    for request_id, event in events:
        if isinstance(event, Refused):
            out.append(
                scheduler_pb2.SubmitResponse(
                    request_id=request_id,
                    finish_reason=generate_pb2.FINISH_REASON_ABORT,
                    error_code=event.code,
                    error_message=event.message,
                )
            )
            continue
        key = (request_id, event.index)
        update = open_updates.get(key)
        if update is None:
            update = open_updates[key] = scheduler_pb2.SubmitResponse(
                request_id=request_id, index=event.index
            )
            out.append(update)
        if isinstance(event, Tokens):
            update.token_ids.extend(event.token_ids)
            update.logprobs.extend(logprob_to_pb(lp) for lp in event.logprobs)
            update.prompt_logprobs.extend(logprob_to_pb(lp) for lp in event.prompt_logprobs)
            if event.cached_tokens is not None:
                update.cached_tokens = event.cached_tokens
            continue
        update.finish_reason = FINISH_TO_PB[event.reason]
        update.usage.CopyFrom(
            generate_pb2.Usage(
                prompt_tokens=event.prompt_tokens,
                completion_tokens=event.completion_tokens,
                cached_tokens=event.cached_tokens,
                num_draft_tokens=event.num_draft_tokens,
                num_accepted_tokens=event.num_accepted_tokens,
            )
        )
        if event.error is not None:
            update.error_code, update.error_message = event.error
        if event.beam_score is not None:
            update.beam_score = event.beam_score
        del open_updates[key]
    return out
