"""Where a worker's KV pool lives in shared memory, as both the worker and the scheduler
see it (`KvSharedMemory` in worker.proto), and its protobuf conversions."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from common.pb.tandem.internal.v1 import worker_pb2

HEADER_BYTES = 4096  # the progress header before the pool


@dataclass(frozen=True)
class SharedMemoryInfo:
    """The fields of `KvSharedMemory`, by name."""

    host_id: str  # equal on two workers that can open each other's memfd by /proc path
    pid: int
    fd: int
    num_bytes: int
    token: bytes
    pool_offset: int = HEADER_BYTES

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "token": self.token.hex()}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SharedMemoryInfo:
        values = json.loads(data)
        return cls(**{**values, "token": bytes.fromhex(values["token"])})

    def reachable_from(self, other: SharedMemoryInfo | None) -> bool:
        """A worker described by `other` can map this pool."""
        return other is not None and other.host_id == self.host_id


def shared_memory_to_pb(info: SharedMemoryInfo) -> worker_pb2.KvSharedMemory:
    return worker_pb2.KvSharedMemory(**asdict(info))


def shared_memory_from_pb(message: worker_pb2.KvSharedMemory) -> SharedMemoryInfo:
    return SharedMemoryInfo(*(getattr(message, f.name) for f in fields(SharedMemoryInfo)))
