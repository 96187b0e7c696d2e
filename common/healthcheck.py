"""`python -m common.healthcheck HOST:PORT`: exit 0 if the service's grpc.health.v1 status
is SERVING (used by compose healthchecks and `make status`)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_status(address: str, timeout_s: float = 1.0) -> str:
    """'SERVING', 'NOT_SERVING', ... or 'UNREACHABLE'."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m common.healthcheck HOST:PORT", file=sys.stderr)
        return 2
    status = health_status(argv[0], timeout_s=3.0)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
