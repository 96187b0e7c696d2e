"""How every Tandem connection notices that its peer is gone when the network, not the
peer, fails: HTTP/2 keepalive pings on every gRPC channel and server.

A cut link, a partition or a half-open connection (packets silently dropped, no RST) gives
TCP nothing to report for minutes: its retransmissions back off for up to ~15 minutes
before it gives up, and a stream over it just stops. With keepalive, each side pings its
peer every `time_s` and closes the connection when a ping is not answered within
`timeout_s`; every call on it then fails UNAVAILABLE (client) or is cancelled (server).
So a dead connection is noticed within `time_s + timeout_s` (6 s by default) on both
sides: the scheduler fails a worker it cannot reach, a worker drops what it holds for a
scheduler that cannot reach it, and the scheduler aborts the requests of a gateway gone
silent. Pings are answered by gRPC's own threads, not the Python event loop, so a busy
or blocked service still answers them (a SIGSTOPped one does not: it counts as gone).

Reconnecting is quick too: a connection attempt is given `connect_timeout_s` (gRPC's
default is 20 s, so a SYN lost to a partition held the channel for 20 s after the heal),
retried at most every second (`grpc_server.RECONNECT_MAX_BACKOFF_MS`).

Settings: `TANDEM_GRPC_KEEPALIVE_TIME_S` (2), `TANDEM_GRPC_KEEPALIVE_TIMEOUT_S` (4),
`TANDEM_GRPC_CONNECT_TIMEOUT_S` (2), read when a channel or server is made.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Keepalive:
    time_s: float = 2.0
    timeout_s: float = 4.0
    connect_timeout_s: float = 2.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Keepalive:
        env = os.environ if env is None else env
        values = {}
        for field, name in (
            ("time_s", "TANDEM_GRPC_KEEPALIVE_TIME_S"),
            ("timeout_s", "TANDEM_GRPC_KEEPALIVE_TIMEOUT_S"),
            ("connect_timeout_s", "TANDEM_GRPC_CONNECT_TIMEOUT_S"),
        ):
            raw = env.get(name)
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {raw!r}")
            values[field] = value
        return cls(**values)

    @property
    def detection_bound_s(self) -> float:
        """The longest a dead connection goes unnoticed."""
        return self.time_s + self.timeout_s

    def channel_options(self) -> tuple[tuple[str, int], ...]:
        return (
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),  # an idle channel is watched too
            ("grpc.http2.max_pings_without_data", 0),  # pings while no call sends data
            ("grpc.min_reconnect_backoff_ms", int(self.connect_timeout_s * 1000)),
        )

    def server_options(self) -> tuple[tuple[str, int], ...]:
        """The server pings its clients too (it must notice a client gone silent), and
        accepts their pings as often as they send them here."""
        interval = int(min(self.time_s, 1.0) * 1000)
        return (
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", interval),
            ("grpc.http2.min_ping_interval_without_data_ms", interval),
            ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
        )
