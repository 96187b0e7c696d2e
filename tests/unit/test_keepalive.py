"""The keepalive settings every gRPC channel and server gets (common/keepalive.py)."""

import pytest

from common.keepalive import Keepalive


def test_defaults_bound_detection_at_six_seconds_and_servers_accept_client_pings():
    keepalive = Keepalive.from_env({})
    assert keepalive.detection_bound_s == 6.0
    channel = dict(keepalive.channel_options())
    assert channel["grpc.keepalive_time_ms"] == 2000
    assert channel["grpc.keepalive_timeout_ms"] == 4000
    assert channel["grpc.keepalive_permit_without_calls"] == 1
    assert channel["grpc.min_reconnect_backoff_ms"] == 2000
    server = dict(keepalive.server_options())
    # A server must not GOAWAY a client for pinging as often as our channels do.
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= 2000
    assert server["grpc.http2.max_ping_strikes"] == 0


def test_settings_come_from_the_environment_and_bad_ones_name_the_variable():
    keepalive = Keepalive.from_env(
        {"TANDEM_GRPC_KEEPALIVE_TIME_S": "10", "TANDEM_GRPC_KEEPALIVE_TIMEOUT_S": "20"}
    )
    assert keepalive.detection_bound_s == 30.0
    assert (
        dict(keepalive.server_options())["grpc.http2.min_recv_ping_interval_without_data_ms"]
        == 1000
    )
    with pytest.raises(ValueError, match="TANDEM_GRPC_KEEPALIVE_TIMEOUT_S must be > 0"):
        Keepalive.from_env({"TANDEM_GRPC_KEEPALIVE_TIMEOUT_S": "0"})
    with pytest.raises(ValueError, match="TANDEM_GRPC_CONNECT_TIMEOUT_S must be a number"):
        Keepalive.from_env({"TANDEM_GRPC_CONNECT_TIMEOUT_S": "soon"})
