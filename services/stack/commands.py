"""The command line of every service of a stack: what `Stack` starts for a `StackSpec`
(each service's flags, addresses and the workers each scheduler is given)."""

from __future__ import annotations

import sys

from services.stack.spec import StackSpec


def service_commands(spec: StackSpec) -> list[tuple[str, str, list[str]]]:
    """(name, address, argv) for every service, workers first, the HTTP front last."""
    py = [sys.executable, "-m"]
    common = ["--model", spec.model, "--log-level", spec.log_level]
    out = []
    roles = (
        [("prefill", p) for p in spec.prefill_ports]
        + [("decode", p) for p in spec.decode_ports]
        + [("both", p) for p in spec.both_ports]
    )
    index = {"prefill": 0, "decode": 0, "both": 0}
    addresses: dict[int, str] = {}  # worker port -> its address
    for role, port in roles:
        own = spec.extra_args.get(f"{role}.{index[role]}", ())
        index[role] += 1
        name = f"{role}-{port}"
        argv = [
            *py,
            "services.worker",
            *common,
            "--role",
            role,
            "--host",
            spec.ip_of(name),
            "--port",
            str(port),
            "--worker-id",
            name,
            *spec.extra_args.get(role, ()),
            *own,
        ]
        out.append((name, f"{spec.ip_of(name)}:{port}", argv))
        addresses[port] = out[-1][1]
    for index, port in enumerate(spec.scheduler_ports):
        workers = ",".join(addresses[p] for p in spec.scheduler_worker_ports(index))
        argv = [
            *py,
            "services.scheduler",
            "--workers",
            workers,
            "--host",
            spec.ip_of(spec.scheduler_name(index)),
            "--port",
            str(port),
            "--log-level",
            spec.log_level,
            *spec.extra_args.get("scheduler", ()),
        ]
        out.append((spec.scheduler_name(index), spec.scheduler_addresses[index], argv))
    out.append(
        (
            "gateway",
            spec.gateway_address,
            [
                *py,
                "services.gateway",
                *common,
                "--host",
                spec.ip_of("gateway"),
                "--port",
                str(spec.gateway_port),
                "--scheduler",
                ",".join(spec.scheduler_addresses),
                *spec.extra_args.get("gateway", ()),
            ],
        )
    )
    if spec.http_port is not None:
        http = [
            *py,
            "services.openai_api",
            "--host",
            spec.ip_of("http"),
            "--port",
            str(spec.http_port),
            "--gateway",
            spec.gateway_address,
            "--log-level",
            spec.log_level,
            *spec.extra_args.get("http", ()),
        ]
        out.append(("http", spec.http_address, http))
    for name, _, argv in out:
        if name != "http" and spec.metrics_port(name) is not None:
            argv += ["--metrics-port", str(spec.metrics_port(name))]
    return out
