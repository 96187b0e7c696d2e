"""Free ports for stacks (`services/stack/ports.py`): below the kernel's ephemeral range
(where outgoing connections take their local ports, so none can take a port between its
handing out and its service's bind), bindable, never handed out twice by one process; the
kernel's choice where no such range exists."""

import socket

from services.stack import ports


def test_ports_come_from_below_the_ephemeral_range_distinct_and_bindable():
    low, high = ports.ephemeral_range()
    assert 1024 <= low <= high
    handed = [ports.free_port() for _ in range(300)]
    assert len(set(handed)) == len(handed)
    assert all(ports.LOWEST <= p < low for p in handed)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", handed[-1]))  # free when handed out


def test_a_busy_port_is_skipped(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        draws = iter([taken, taken, taken + 1 if taken + 1 < 65536 else taken - 1])
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65000, 65535))
        monkeypatch.setattr(ports, "LOWEST", 1024)
        monkeypatch.setattr(ports._draw, "randrange", lambda a, b: next(draws))
        monkeypatch.setattr(ports, "_handed", set())
        assert ports.free_port() != taken


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    real_low, real_high = ports.ephemeral_range()  # where the kernel picks a port 0 from
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, real_high))
    port = ports.free_port()
    assert real_low <= port <= real_high and port in ports._handed
