"""`python -m common.healthcheck [--http] HOST:PORT`: exit 0 if the service is SERVING —
its grpc.health.v1 status, or with --http the HTTP front's `GET /health` answering 200 (it
does only while the gateway is SERVING). Used by compose healthchecks, `make up` and
`make status`."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Loopback probes must not go through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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


def http_health_status(address: str, timeout_s: float = 1.0) -> str:
    """'SERVING' (200), 'NOT_SERVING' (another status) or 'UNREACHABLE'."""
    try:
        with _OPENER.open(f"http://{address}/health", timeout=timeout_s) as reply:
            return "SERVING" if reply.status == 200 else "NOT_SERVING"
    except urllib.error.HTTPError:
        return "NOT_SERVING"
    except (OSError, ValueError):
        return "UNREACHABLE"


def main(argv: list[str]) -> int:
    http = argv[:1] == ["--http"]
    if http:
        argv = argv[1:]
    if len(argv) != 1:
        print("usage: python -m common.healthcheck [--http] HOST:PORT", file=sys.stderr)
        return 2
    status = (http_health_status if http else health_status)(argv[0], timeout_s=3.0)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
