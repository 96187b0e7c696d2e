"""What `python -m services.stack up --schedulers N` starts (no process is started here):
N schedulers on consecutive ports, each with its own share of the workers, one gateway
fronting them all; and `status` listing every one of them."""

import pytest

from services.stack.__main__ import main, parse_args, spec_from_args
from services.stack.commands import service_commands as _commands
from services.stack.launcher import Process, Stack, StackSpec


def commands(argv):
    spec = spec_from_args(parse_args(["up", *argv]), "/models/m")
    return spec, {name: argv for name, _, argv in _commands(spec)}


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_one_scheduler_is_todays_stack():
    spec, argvs = commands([])
    assert spec.num_schedulers == 1
    assert list(argvs) == ["prefill-50061", "decode-50071", "scheduler", "gateway", "http"]
    assert flag(argvs["scheduler"], "--workers") == "127.0.0.1:50061,127.0.0.1:50071"
    assert flag(argvs["gateway"], "--scheduler") == "127.0.0.1:50052"


def test_two_schedulers_each_get_their_own_workers_and_the_gateway_fronts_both():
    spec, argvs = commands(["--schedulers", "2", "--prefill", "1", "--decode", "2", "--no-http"])
    assert spec.scheduler_addresses == ["127.0.0.1:50052", "127.0.0.1:50053"]
    assert [n for n in argvs if n.startswith("scheduler")] == ["scheduler-0", "scheduler-1"]
    assert flag(argvs["scheduler-0"], "--port") == "50052"
    assert flag(argvs["scheduler-0"], "--workers") == (
        "127.0.0.1:50061,127.0.0.1:50071,127.0.0.1:50072"
    )
    assert flag(argvs["scheduler-1"], "--port") == "50053"
    assert flag(argvs["scheduler-1"], "--workers") == (
        "127.0.0.1:50062,127.0.0.1:50073,127.0.0.1:50074"
    )
    assert flag(argvs["gateway"], "--scheduler") == "127.0.0.1:50052,127.0.0.1:50053"
    assert len([n for n in argvs if n.startswith(("prefill-", "decode-"))]) == 6


def test_workers_must_split_evenly_and_ports_must_not_collide():
    with pytest.raises(ValueError, match="3 decode workers cannot be split evenly among 2"):
        StackSpec(
            model="m", more_scheduler_ports=(50053,), prefill_ports=(1, 2), decode_ports=(3, 4, 5)
        )
    with pytest.raises(ValueError, match="ports must be distinct"):
        StackSpec(  # the second scheduler on the first prefill port
            model="m",
            more_scheduler_ports=(50061,),
            prefill_ports=(50061, 50062),
            decode_ports=(50071, 50072),
        )
    assert main(["up", "--schedulers", "0"]) == 2


def test_status_lists_every_scheduler_and_its_workers(tmp_path, capsys):
    spec = StackSpec.on_free_ports("/models/m", schedulers=2)  # nothing listens there
    processes = [Process(name, address, 0, "") for name, address, _ in _commands(spec)]
    Stack(spec, tmp_path, processes).save()
    assert main(["--run-dir", str(tmp_path), "status"]) == 1  # not SERVING
    out = capsys.readouterr().out
    for name, address, _ in _commands(spec):
        assert f"{name:<14} {address:<22} UNREACHABLE" in out
    assert "scheduler-0" in out and "scheduler-1" in out


def test_metrics_ports_and_served_names_reach_every_scheduler_and_worker():
    spec, argvs = commands(
        ["--schedulers", "2", "--metrics-port-base", "9100", "--served-model-name", "a", "b"]
    )
    ports = {name: flag(argv, "--metrics-port") for name, argv in argvs.items() if name != "http"}
    assert ports == {
        "gateway": "9100", "scheduler-0": "9101", "scheduler-1": "9102",
        "prefill-50061": "9103", "prefill-50062": "9104",
        "decode-50071": "9105", "decode-50072": "9106",
    }  # fmt: skip
    assert "--metrics-port" not in argvs["http"]  # it serves GET /metrics on its own port
    assert argvs["gateway"][argvs["gateway"].index("--served-model-name") :][1:3] == ["a", "b"]
    free = StackSpec.on_free_ports("/models/m", schedulers=2, metrics=True, http=True)
    assert len(free.metrics_ports) == 1 + 2 + 4
    assert free.metrics_port("scheduler-1") == free.metrics_ports[2]
