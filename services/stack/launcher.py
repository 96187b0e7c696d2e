"""Start and stop a whole Tandem deployment as local processes: workers, scheduler(s),
gateway and, when asked for, the OpenAI-compatible HTTP front. With several schedulers
(`more_scheduler_ports`), the workers are split among them in order (each gets the same
number of each role) and the gateway fronts them all.

`make up` / `make down` use it through `python -m services.stack`, and the end-to-end tests
use `Stack` directly on free loopback ports. Each service is a real process
(`python -m services.<name>`), started in its own session with its log in `log_dir`;
`stack.json` in `run_dir` records what was started so `down` can stop it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from common.fork_protocol import RANK_MODULE, RANK_SERVER_ENV, ForkedProcess, ForkServerError
from common.healthcheck import health_status, http_health_status
from common.tls import TlsSettings
from services.stack.commands import service_commands
from services.stack.fork_server import shared_fork_server
from services.stack.spec import StackSpec

ROOT = Path(__file__).resolve().parents[2]
STATE_FILE = "stack.json"


@dataclass
class Process:
    name: str
    address: str
    pid: int
    log: str
    probe: str = "grpc"  # how its health is read: grpc.health.v1, or "http" GET /health
    metrics: str | None = None  # where Prometheus scrapes it (host:port), if anywhere


def process_health(process: Process, tls: TlsSettings | None = None) -> str:
    """'SERVING', 'NOT_SERVING' or 'UNREACHABLE', whichever kind of service it is (`tls`:
    the settings the services were started with; default this process's environment)."""
    if process.probe == "http":
        return http_health_status(process.address, tls=tls)
    return health_status(process.address, tls=tls)


class Stack:
    def __init__(
        self,
        spec: StackSpec,
        run_dir: Path,
        processes: list[Process],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.processes = processes
        self._env = dict(env) if env is not None else None
        self._fork_servers = False  # start the services through fork servers (`start`)
        self._forked: dict[int, ForkedProcess] = {}  # the children of fork servers, by pid
        # The probes speak TLS exactly when the services were started with it.
        self.tls = TlsSettings.from_env(self._env) if env is not None else None

    def _launch(self, name: str, address: str, argv: list[str]) -> Process:
        log_path = self.run_dir / "logs" / f"{name}.log"
        probe = "http" if name == "http" else "grpc"
        env = self._env if self._env is not None else os.environ
        netns = self.spec.netns_of(name)
        server = None
        if self._fork_servers and argv[1:2] == ["-m"]:
            server = shared_fork_server(argv[2], env, str(ROOT))
        if server is not None:
            try:
                pid = server.spawn(argv[2], argv[3:], self._with_rank_server(argv, env, netns),
                                   str(ROOT), str(log_path), netns=netns)  # fmt: skip
            except ForkServerError:
                pass  # refused (an import-time variable differs): start it fresh below
            else:
                self._forked[pid] = ForkedProcess(server, pid)
                return Process(name, address, pid, str(log_path), probe, self._metrics_at(name))
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self._env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return Process(name, address, proc.pid, str(log_path), probe, self._metrics_at(name))

    def _with_rank_server(
        self, argv: list[str], env: Mapping[str, str], netns: str | None = None
    ) -> Mapping[str, str]:
        """A worker with ranks of its own forks them through a fork server too (not one on
        a host of its own)."""
        if argv[2] != "services.worker" or not any("parallel-size" in a for a in argv):
            return env
        if netns is not None:  # ranks must share its namespace: it starts them itself
            return env
        server = shared_fork_server(RANK_MODULE, env, str(ROOT))
        if server is None:
            return env
        return {**env, RANK_SERVER_ENV: server.socket_path}

    def _metrics_at(self, name: str) -> str | None:
        """host:port of the service's GET /metrics (the HTTP front's is its own port)."""
        if name == "http":
            return self.spec.http_address
        port = self.spec.metrics_port(name)
        return None if port is None else f"{self.spec.ip_of(name)}:{port}"

    def process(self, name: str) -> Process:
        """The service called `name` ("gateway", "scheduler", "decode-50071", ...)."""
        for process in self.processes:
            if process.name == name:
                return process
        raise KeyError(f"no process {name!r}; have {[p.name for p in self.processes]}")

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send `sig` to one service (fault injection: SIGKILL, SIGSTOP, SIGCONT, SIGTERM)."""
        self._signal(self.process(name), sig)

    def wait_exit(self, name: str, timeout_s: float = 30.0) -> int | None:
        """Wait until the service has exited; its exit code when we or a fork server
        started it."""
        process, deadline = self.process(name), time.monotonic() + timeout_s
        while True:
            try:
                pid, status = os.waitpid(process.pid, os.WNOHANG)
            except ChildProcessError:  # not our child: a fork server's, or another's
                if not self.alive(process):
                    forked = self._forked.get(process.pid)
                    return None if forked is None else forked.returncode
            else:
                if pid:
                    return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} still running after {timeout_s}s")
            time.sleep(0.05)

    def restart(
        self, name: str, ready_timeout_s: float = 120.0, exit_timeout_s: float = 10.0
    ) -> Process:
        """Start a stopped or killed service again with its original command line."""
        return self.restart_all([name], ready_timeout_s, exit_timeout_s)[0]

    def restart_all(
        self, names: list[str], ready_timeout_s: float = 120.0, exit_timeout_s: float = 10.0
    ) -> list[Process]:
        """`restart` several services at once: all are started, then all waited for. One
        killed a moment ago may not have exited yet: each is given up to `exit_timeout_s`
        in all; one still running after that is refused (RuntimeError), never killed."""
        olds = [self.process(name) for name in names]
        deadline = time.monotonic() + exit_timeout_s
        for old in olds:
            try:
                self.wait_exit(old.name, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RuntimeError(
                    f"{old.name} is still running (pid {old.pid}) after {exit_timeout_s}s"
                ) from None
        argvs = {n: argv for n, _, argv in service_commands(self.spec)}
        news = [self._launch(old.name, old.address, argvs[old.name]) for old in olds]
        for old, new in zip(olds, news, strict=True):
            self.processes[self.processes.index(old)] = new
        self.save()
        self.wait_serving(ready_timeout_s, news)
        return news

    @classmethod
    def start(
        cls,
        spec: StackSpec,
        run_dir: str | os.PathLike,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 300.0,
        exit_with_parent: bool = False,
        fork_server: bool = False,
    ) -> Stack:
        """Start every service and wait until all report SERVING; on failure stop them all.

        With exit_with_parent the services stop by themselves once this process is gone
        (tests, benchmarks); `make up` leaves it off so the stack outlives the command.
        With fork_server (only beside exit_with_parent) each service is forked from a
        process that has imported its modules once (`fork_server.py`): seconds less per
        stack start, for test suites that start hundreds of processes.
        """
        if fork_server and not exit_with_parent:
            raise ValueError("fork_server needs exit_with_parent (the server ends with us)")
        run_dir = Path(run_dir)
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        if exit_with_parent:
            child_env["TANDEM_EXIT_WITH_PARENT"] = "1"
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), child_env.get("PYTHONPATH", "")) if p
        )
        stack = cls(spec, run_dir, [], child_env)
        stack._fork_servers = fork_server
        for name, address, argv in service_commands(spec):
            stack.processes.append(stack._launch(name, address, argv))
        stack.save()
        try:
            stack.wait_serving(ready_timeout_s)
        except Exception:
            stack.stop()
            raise
        return stack

    def save(self) -> None:
        state = {
            "spec": {**asdict(self.spec), "extra_args": dict(self.spec.extra_args)},
            "processes": [asdict(p) for p in self.processes],
        }
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=2))

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> Stack | None:
        path = Path(run_dir) / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        spec = state["spec"]
        for key in (
            "prefill_ports",
            "decode_ports",
            "both_ports",
            "more_scheduler_ports",
            "metrics_ports",
        ):
            spec[key] = tuple(spec.get(key, ()))
        return cls(StackSpec(**spec), Path(run_dir), [Process(**p) for p in state["processes"]])

    def alive(self, process: Process) -> bool:
        """Whether the service still runs (a zombie does not: the exited process that its
        parent has not reaped yet still answers kill(0))."""
        forked = self._forked.get(process.pid)
        if forked is not None:  # its parent, the fork server, knows
            return forked.poll() is None
        try:
            os.kill(process.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie child of this process still answers kill(0): reap it.
        try:
            pid, _ = os.waitpid(process.pid, os.WNOHANG)
            return pid == 0
        except ChildProcessError:
            return True

    def wait_serving(self, timeout_s: float, processes: list[Process] | None = None) -> None:
        """Wait until every process (default: all of them) reports SERVING."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.processes if processes is None else processes)
        while pending:
            for process in list(pending):
                if not self.alive(process):
                    raise RuntimeError(
                        f"{process.name} exited during startup; last log lines:\n"
                        + self.log_tail(process)
                    )
                if process_health(process, self.tls) == "SERVING":
                    pending.remove(process)
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise TimeoutError(f"not SERVING after {timeout_s:.0f}s: {names}")
            if pending:
                time.sleep(0.2)

    def log_tail(self, process: Process, lines: int = 20) -> str:
        try:
            return "\n".join(Path(process.log).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every service (front ends first), then SIGKILL what is left."""
        for process in reversed(self.processes):
            self._signal(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.alive(p) for p in self.processes):
            time.sleep(0.1)
        for process in self.processes:
            if self.alive(process):
                self._signal(process, signal.SIGKILL)
        state = self.run_dir / STATE_FILE
        if state.exists():
            state.unlink()

    @staticmethod
    def _signal(process: Process, sig: signal.Signals) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
