"""`python -m services.openai_api.healthcheck HOST:PORT`: exit 0 if the HTTP front's
`GET /health` answers 200 (it does only while the gateway is SERVING). Used by compose
healthchecks and by `make up` / `make status`."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

# Loopback probes must not go through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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
    if len(argv) != 1:
        print("usage: python -m services.openai_api.healthcheck HOST:PORT", file=sys.stderr)
        return 2
    status = http_health_status(argv[0], timeout_s=3.0)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
