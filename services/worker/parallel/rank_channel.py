"""The pipes between rank 0 and each other rank of a parallel worker: framed messages (a kind
byte, a 4-byte length, the payload). Rank 0 -> rank: steps (the `StepRequest` protobuf as the
scheduler sent it), resets, and its part of KV transfers over UCX (JSON); rank -> rank 0:
the outcome of those transfers (JSON). Nothing is pickled. End of file on rank 0's pipe
(rank 0 gone) ends the peer."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator

STEP = b"S"  # payload: a StepRequest
RESET = b"R"  # forget every request (a new Step stream)
KV_SEND = b"K"  # gather these slices of these blocks and send them over UCX
KV_RECV = b"V"  # post UCX receives for these slices of these blocks
KV_SCATTER = b"W"  # the receives of this transfer into the pool now (ordered with steps)
KV_DROP = b"D"  # give up this transfer's receives
ANSWER = b"A"  # rank -> rank 0: a KV send or receive ended (ok or its error)
_HEADER = struct.Struct(">cI")


_WRITE_LOCK = threading.Lock()  # threads of one process write whole messages


def write_message(fd: int, kind: bytes, payload: bytes = b"") -> None:
    data = memoryview(_HEADER.pack(kind, len(payload)) + payload)
    with _WRITE_LOCK:
        while data:
            data = data[os.write(fd, data) :]


def write_json(fd: int, kind: bytes, body: dict) -> None:
    write_message(fd, kind, json.dumps(body, separators=(",", ":")).encode())


def _read_exactly(fd: int, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_messages(fd: int) -> Iterator[tuple[bytes, bytes]]:
    """(kind, payload) until rank 0 closes the pipe."""
    while (header := _read_exactly(fd, _HEADER.size)) is not None:
        kind, size = _HEADER.unpack(header)
        payload = _read_exactly(fd, size) if size else b""
        if payload is None:
            return
        yield kind, payload
