"""The pipe from rank 0 to each other rank of a parallel worker: framed messages (a kind
byte, a 4-byte length, the payload). A step's payload is the `StepRequest` protobuf as the
scheduler sent it; nothing is pickled. End of file (rank 0 gone) ends the peer."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

STEP = b"S"  # payload: a StepRequest
RESET = b"R"  # forget every request (a new Step stream)
_HEADER = struct.Struct(">cI")


def write_message(fd: int, kind: bytes, payload: bytes = b"") -> None:
    data = memoryview(_HEADER.pack(kind, len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


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
