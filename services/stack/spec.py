"""What a stack is made of (`StackSpec`): the model, every service's port, the workers'
shape and extra flags, the hosts (network namespaces) they run on; and `on_free_ports`, a
spec on ports nothing listens on. `launcher.Stack` starts one, `commands.py` writes its
command lines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.stack.ports import free_port


@dataclass(frozen=True)
class StackSpec:
    model: str
    host: str = "127.0.0.1"
    gateway_port: int = 50051
    scheduler_port: int = 50052
    # Further schedulers (each with its own share of the workers); the gateway fronts all.
    more_scheduler_ports: tuple[int, ...] = ()
    prefill_ports: tuple[int, ...] = (50061,)
    decode_ports: tuple[int, ...] = (50071,)
    both_ports: tuple[int, ...] = ()
    # Extra CLI flags per role ("prefill", "decode", "both", "scheduler", "gateway", "http"),
    # and per worker ("decode.1": the second decode worker's, after its role's).
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    log_level: str = "info"
    # The OpenAI-compatible HTTP front's port (python -m services.openai_api); None = none.
    http_port: int | None = None
    # Prometheus endpoints (--metrics-port) of the gRPC services, in the order gateway,
    # schedulers, then the workers (prefill, decode, both); () = off. The HTTP front serves
    # GET /metrics on its own port.
    metrics_ports: tuple[int, ...] = ()
    # Several hosts (`services/stack/hosts.py`): service name ("gateway", "scheduler",
    # "decode-50071", "http", as `service_commands` names them) -> (network namespace, address)
    # it runs in and listens on. A service not named runs where `host` is.
    hosts: Mapping[str, Sequence[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.both_ports and (self.prefill_ports or self.decode_ports):
            raise ValueError("use either both-role workers or prefill + decode workers")
        if not self.both_ports and not (self.prefill_ports and self.decode_ports):
            raise ValueError("a disaggregated stack needs >= 1 prefill and >= 1 decode worker")
        for role, count in (
            ("prefill", len(self.prefill_ports)),
            ("decode", len(self.decode_ports)),
            ("both", len(self.both_ports)),
        ):
            if count % self.num_schedulers:
                raise ValueError(
                    f"{count} {role} workers cannot be split evenly among "
                    f"{self.num_schedulers} schedulers"
                )
        ports = [self.gateway_port, *self.scheduler_ports, *self.worker_ports]
        if self.http_port is not None:
            ports.append(self.http_port)
        num_grpc = 1 + self.num_schedulers + len(self.worker_ports)
        if self.metrics_ports and len(self.metrics_ports) != num_grpc:
            raise ValueError(
                f"metrics_ports needs {num_grpc} ports (gateway, each scheduler, each worker), "
                f"got {len(self.metrics_ports)}"
            )
        ports += self.metrics_ports
        if len(set(ports)) != len(ports):
            raise ValueError(f"ports must be distinct, got {ports}")

    @property
    def worker_ports(self) -> list[int]:
        return [*self.prefill_ports, *self.decode_ports, *self.both_ports]

    def metrics_port(self, name: str) -> int | None:
        """The metrics port of service `name` ('gateway', 'scheduler', 'decode-50071')."""
        if not self.metrics_ports:
            return None
        workers = [
            f"{role}-{p}"
            for role, ports in (
                ("prefill", self.prefill_ports),
                ("decode", self.decode_ports),
                ("both", self.both_ports),
            )
            for p in ports
        ]
        schedulers = [self.scheduler_name(i) for i in range(self.num_schedulers)]
        names = ["gateway", *schedulers, *workers]
        return dict(zip(names, self.metrics_ports, strict=True)).get(name)

    def ip_of(self, name: str) -> str:
        """The address service `name` listens on."""
        placed = self.hosts.get(name)
        return self.host if placed is None else placed[1]

    def netns_of(self, name: str) -> str | None:
        placed = self.hosts.get(name)
        return None if placed is None else placed[0]

    @property
    def gateway_address(self) -> str:
        return f"{self.ip_of('gateway')}:{self.gateway_port}"

    @property
    def scheduler_address(self) -> str:
        """The (first) scheduler's address."""
        return self.scheduler_addresses[0]

    @property
    def scheduler_ports(self) -> tuple[int, ...]:
        return (self.scheduler_port, *self.more_scheduler_ports)

    @property
    def num_schedulers(self) -> int:
        return 1 + len(self.more_scheduler_ports)

    @property
    def scheduler_addresses(self) -> list[str]:
        return [
            f"{self.ip_of(self.scheduler_name(i))}:{port}"
            for i, port in enumerate(self.scheduler_ports)
        ]

    def scheduler_name(self, index: int) -> str:
        """ "scheduler" when there is one, else "scheduler-0", "scheduler-1", ..."""
        return "scheduler" if self.num_schedulers == 1 else f"scheduler-{index}"

    def scheduler_worker_ports(self, index: int) -> list[int]:
        """The worker ports of scheduler `index`: its share of each role, in order."""
        out = []
        for ports in (self.prefill_ports, self.decode_ports, self.both_ports):
            share = len(ports) // self.num_schedulers
            out += ports[index * share : (index + 1) * share]
        return out

    @property
    def http_address(self) -> str | None:
        return None if self.http_port is None else f"{self.ip_of('http')}:{self.http_port}"

    @classmethod
    def on_free_ports(
        cls,
        model: str,
        prefill: int = 1,
        decode: int = 1,
        both: int = 0,
        http: bool = False,
        schedulers: int = 1,
        metrics: bool = False,
        **kwargs,
    ) -> StackSpec:
        """Every service on a free loopback port; `http` adds the HTTP front on one too,
        `metrics` a metrics port for each gRPC service. The worker counts are per
        scheduler."""
        n = schedulers
        num_grpc = 1 + n * (1 + prefill + decode + both)
        ports = iter(_distinct_free_ports(num_grpc * (1 + int(metrics)) + int(http)))
        return cls(
            model=model,
            gateway_port=next(ports),
            scheduler_port=next(ports),
            more_scheduler_ports=tuple(next(ports) for _ in range(n - 1)),
            prefill_ports=tuple(next(ports) for _ in range(n * prefill)),
            decode_ports=tuple(next(ports) for _ in range(n * decode)),
            both_ports=tuple(next(ports) for _ in range(n * both)),
            http_port=next(ports) if http else None,
            metrics_ports=tuple(next(ports) for _ in range(num_grpc)) if metrics else (),
            **kwargs,
        )


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
