"""The Responses API's store: responses created with `store: true`, kept in this HTTP front's
memory for `GET`/`DELETE /v1/responses/{id}` and for `previous_response_id`, bounded by a
size (approximate bytes held; the least recently stored or read go first) and an expiry
(seconds since a response was stored). Pure: the clock is injectable.

Each entry holds the response object as answered and the conversation that continues it:
the messages that went to the model (the request's `instructions` excepted: per OpenAI they
do not carry over) and the assistant's answer, as chat-completions messages. A conversation
shares its history's message dicts with the entry it continued, so an entry's size counts
only the messages it adds, plus a pointer per message it shares."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

POINTER_BYTES = 8
ENTRY_OVERHEAD_BYTES = 256


def json_size(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


@dataclass(frozen=True)
class StoredResponse:
    body: dict
    conversation: tuple[dict, ...]
    size: int
    expires_at: float
    owner: str = ""  # whose credentials stored it: only they may read or delete it


class ResponseStore:
    """`max_bytes` 0 stores nothing (every `store: true` is then not retrievable)."""

    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_bytes < 0 or ttl_s <= 0:
            raise ValueError("max_bytes must be >= 0 and ttl_s > 0")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recent first
        self._by_age: OrderedDict[str, float] = OrderedDict()  # oldest first: expires first
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def bytes_held(self) -> int:
        self._expire()
        return self._bytes

    def put(
        self,
        response_id: str,
        body: dict,
        history: tuple[dict, ...],
        added: list[dict],
        owner: str = "",
    ) -> None:
        """Store `body` with the conversation `history + added` (`history` is the entry it
        continued's, shared). An entry larger than the whole store is not kept."""
        self._expire()
        self._drop(response_id)
        size = (
            ENTRY_OVERHEAD_BYTES
            + json_size(body)
            + sum(json_size(m) for m in added)
            + POINTER_BYTES * len(history)
        )
        if size > self.max_bytes:
            return
        while self._entries and self._bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        expires_at = self._clock() + self.ttl_s
        self._entries[response_id] = StoredResponse(
            body, (*history, *added), size, expires_at, owner
        )
        self._by_age[response_id] = expires_at
        self._bytes += size

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None when unknown, deleted, evicted or expired. A read makes it
        the most recently used (last to be evicted for room; its expiry stays)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        del self._by_age[response_id]
        self._bytes -= entry.size
        return True

    def _expire(self) -> None:
        now = self._clock()
        while self._by_age and next(iter(self._by_age.values())) <= now:
            self._drop(next(iter(self._by_age)))
