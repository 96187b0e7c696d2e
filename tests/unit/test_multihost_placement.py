"""Which host each service of a multi-host stack runs on, and the addresses it is given."""

import pytest

from services.stack.commands import service_commands
from services.stack.hosts import Fabric
from services.stack.launcher import StackSpec
from services.stack.multihost import default_placement, host_of, place


def fabric(num_hosts: int) -> Fabric:
    """A fabric's description only (no namespaces are made)."""
    hosts = [[i, f"ns-h{i}", f"10.9.{i}.2"] for i in range(num_hosts)]
    return Fabric.from_state(
        {"net": 9, "router": "ns-r", "mgmt": "ns-m", "made": [], "hosts": hosts}
    )


def spec(**kwargs) -> StackSpec:
    defaults = dict(model="m", prefill_ports=(7001,), decode_ports=(7002, 7003), http_port=7009)
    return StackSpec(**{**defaults, **kwargs})


def test_default_placement_gives_the_front_host_0_and_spreads_the_rest_in_turn():
    names = ["prefill-1", "decode-2", "decode-3", "scheduler", "gateway", "http"]
    assert default_placement(names, 5) == {
        "gateway": 0, "http": 0, "scheduler": 1, "prefill-1": 2, "decode-2": 3, "decode-3": 4,
    }  # fmt: skip
    assert default_placement(names, 3) == {
        "gateway": 0, "http": 0, "scheduler": 1, "prefill-1": 2, "decode-2": 1, "decode-3": 2,
    }  # fmt: skip
    assert set(default_placement(names, 1).values()) == {0}
    with pytest.raises(ValueError, match="--hosts"):
        default_placement(names, 0)


def test_every_service_listens_on_its_hosts_address_and_is_called_there():
    f = fabric(4)
    placed = place(spec(), f, {"gateway": 0, "http": 0, "scheduler": 1, "prefill-7001": 2,
                               "decode-7002": 3, "decode-7003": 2})  # fmt: skip
    commands = {name: (address, argv) for name, address, argv in service_commands(placed)}
    assert commands["decode-7002"][0] == "10.9.3.2:7002"
    assert commands["decode-7003"][0] == "10.9.2.2:7003"
    scheduler_argv = commands["scheduler"][1]
    workers = scheduler_argv[scheduler_argv.index("--workers") + 1]
    assert workers == "10.9.2.2:7001,10.9.3.2:7002,10.9.2.2:7003"
    assert scheduler_argv[scheduler_argv.index("--host") + 1] == "10.9.1.2"
    gateway_argv = commands["gateway"][1]
    assert gateway_argv[gateway_argv.index("--scheduler") + 1] == "10.9.1.2:50052"
    assert placed.http_address == "10.9.0.2:7009"
    http_argv = commands["http"][1]
    assert http_argv[http_argv.index("--gateway") + 1] == "10.9.0.2:50051"
    assert placed.netns_of("decode-7002") == "ns-h3" and host_of(placed, f, "decode-7002") == 3


def test_a_placement_must_name_every_service_and_only_hosts_that_exist():
    with pytest.raises(ValueError, match="leaves out"):
        place(spec(), fabric(2), {"gateway": 0})
    everything = {"gateway": 0, "http": 0, "scheduler": 1, "prefill-7001": 1,
                  "decode-7002": 1, "decode-7003": 5}  # fmt: skip
    with pytest.raises(ValueError, match="host 5"):
        place(spec(), fabric(2), everything)
