"""Fork servers for stacks started by tests and benchmarks: one process per service
imports what that service imports (a worker: torch, ~2.8 of its ~3.4 s; the gateway: its
tokenizer's `transformers`, ~1.8 s) once, then forks each new process of that service from
that state instead of starting a fresh interpreter that imports it all again. The forked
child becomes the service exactly as `python -m services.<name> ARGS` would: its own
session, working directory, environment and log file.

Only what cannot differ between children is shared. The server serves a start only when
the child's environment agrees with its own on every variable read while modules are
imported (OpenMP, MKL, torch, Triton, the loader, Python, gRPC, UCX, Hugging Face:
`IMPORT_TIME_PREFIXES`);
otherwise the caller starts the process as usual. The server reaps its children and keeps
their exit codes, so the caller can still ask how a worker ended. It exits when the process
that started it is gone, and its children, started with `TANDEM_EXIT_WITH_PARENT=1`, follow.

Protocol: one JSON request per connection on a Unix socket, one JSON reply.
  {"op": "spawn", "module": M, "args": [...], "env": {...}, "cwd": D, "log": F} -> {"pid": N}
  (M: the one module this server was started for)
  {"op": "exit_code", "pid": N} -> {"known": bool, "exit_code": int | null (still running)}
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path


# What each service's server imports before it forks (the service's own `__main__` and
# its imports; the gateway also its tokenizer's `transformers` modules, ~1.8 s of each
# start, after marking torch absent as its `main` does). One server per service.
def _keep_torch_out() -> None:
    from services.gateway.__main__ import keep_torch_out

    keep_torch_out()


PRELOADS: dict[str, tuple[str, ...]] = {
    "services.worker": ("services.worker.__main__",),
    "services.gateway": (
        "services.gateway.__main__",
        "transformers.models.auto.tokenization_auto",
    ),
    "services.scheduler": ("services.scheduler.__main__",),
    "services.openai_api": ("services.openai_api.__main__",),
}
_BEFORE_PRELOAD = {"services.gateway": _keep_torch_out}


# Variables that libraries read when they are loaded (so a forked child could not change
# them): a child whose values differ is started the usual way.
IMPORT_TIME_PREFIXES = (
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH_",
    "TRITON_", "CUDA_", "NVIDIA_", "LD_", "MALLOC_", "PYTHON", "GRPC_", "UCX", "THP_",
    "HF_", "TRANSFORMERS_", "TOKENIZERS_",
)  # fmt: skip
_PARENT_POLL_S = 0.5


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` that modules read while they are imported."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


class ForkServerClient:
    """The starting side: launches the server process and asks it for children."""

    def __init__(
        self, module: str, env: Mapping[str, str], cwd: str, ready_timeout_s: float = 120.0
    ):
        if module not in PRELOADS:
            raise ValueError(f"no fork server for {module!r}; there are: {sorted(PRELOADS)}")
        self.module = module
        self.env = dict(env)
        self.signature = import_time_env(env)
        self.directory = Path(tempfile.mkdtemp(prefix="tandem-fork-"))
        self.socket_path = str(self.directory / "server.sock")
        self.log_path = self.directory / "server.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "services.stack.fork_server", module, self.socket_path],
                cwd=cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + ready_timeout_s
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"fork server did not start: {self.log_path.read_text()}")
            time.sleep(0.05)

    def serves(self, module: str, env: Mapping[str, str]) -> bool:
        return (
            module == self.module
            and self.process.poll() is None
            and import_time_env(env) == self.signature
        )

    def spawn(
        self, module: str, args: list[str], env: Mapping[str, str], cwd: str, log: str
    ) -> int:
        request = {"op": "spawn", "module": module, "args": list(args), "env": dict(env),
                   "cwd": cwd, "log": log}  # fmt: skip
        return int(self._ask(request)["pid"])

    def exit_code(self, pid: int) -> tuple[bool, int | None]:
        """(whether `pid` is this server's child, its exit code or None while it runs)."""
        reply = self._ask({"op": "exit_code", "pid": pid})
        return bool(reply["known"]), reply["exit_code"]

    def _ask(self, request: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(self.socket_path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            reply = sock.makefile("rb").readline()
        if not reply:
            raise RuntimeError(f"fork server gave no reply: {self.log_path.read_text()[-2000:]}")
        answer = json.loads(reply)
        if "error" in answer:
            raise RuntimeError(f"fork server refused {request['op']}: {answer['error']}")
        return answer


_shared: dict[tuple[str, frozenset[tuple[str, str]]], ForkServerClient] = {}
MAX_SHARED = 8  # servers per starting process (the worker's holds ~0.3 GB of modules)


def shared_fork_server(module: str, env: Mapping[str, str], cwd: str) -> ForkServerClient | None:
    """This process's server for `module` children with `env`'s import-time settings,
    started on first use; None where there is none (the caller starts the process)."""
    if module not in PRELOADS:
        return None
    key = (module, frozenset(import_time_env(env).items()))
    server = _shared.get(key)
    if server is not None and server.process.poll() is None:
        return server
    if server is None and len(_shared) >= MAX_SHARED:
        return None
    try:
        server = ForkServerClient(module, env, cwd)
    except (OSError, RuntimeError) as exc:
        print(f"tandem: no fork server ({exc}); starting processes directly", file=sys.stderr)
        return None
    _shared[key] = server
    return server


# --- the server process ------------------------------------------------------------------

_exit_codes: dict[int, int | None] = {}
# Variables the preloaded modules set for themselves at import (`os.environ.setdefault`):
# a fresh interpreter would set them too, so every child gets them where its env has none.
_set_by_imports: dict[str, str] = {}


def _reap(*_: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _exit_codes[pid] = os.waitstatus_to_exitcode(status)


def _become_child(request: dict) -> None:
    """In the forked child: turn into `python -m MODULE ARGS`; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in _set_by_imports.items():
            os.environ.setdefault(name, value)
        import random

        random.seed()  # the server's state would otherwise be every child's
        import runpy

        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        code = _shut_down_like_an_interpreter(code)
        os._exit(code)


def _exit_status(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _shut_down_like_an_interpreter(code: int) -> int:
    """What a normal interpreter exit runs: join non-daemon threads, then atexit."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def _serve_one(conn: socket.socket, listener: socket.socket, module: str) -> None:
    request = json.loads(conn.makefile("rb").readline())
    if request["op"] == "spawn":
        if request["module"] != module:
            raise ValueError(f"module {request['module']!r} is not served here ({module} is)")
        pid = os.fork()
        if pid == 0:
            conn.close()
            listener.close()
            _become_child(request)
        _exit_codes.setdefault(pid, None)
        reply: dict = {"pid": pid}
    elif request["op"] == "exit_code":
        pid = int(request["pid"])
        _reap()
        reply = {"known": pid in _exit_codes, "exit_code": _exit_codes.get(pid)}
    else:
        raise ValueError(f"unknown op {request['op']!r}")
    conn.sendall(json.dumps(reply).encode() + b"\n")


def serve(module: str, socket_path: str) -> None:
    parent = os.getppid()
    before = dict(os.environ)
    if module in _BEFORE_PRELOAD:
        _BEFORE_PRELOAD[module]()
    for name in PRELOADS[module]:
        importlib.import_module(name)
    # Its imports stay loaded; the module itself runs afresh in each child.
    sys.modules.pop(module + ".__main__", None)
    _set_by_imports.update((k, v) for k, v in os.environ.items() if before.get(k) != v)
    signal.signal(signal.SIGCHLD, _reap)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(16)
    os.rename(socket_path + ".tmp", socket_path)  # the client waits for this name
    listener.settimeout(_PARENT_POLL_S)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(30)
            try:
                _serve_one(conn, listener, module)
            except Exception as exc:  # a bad request fails that request, not the server
                conn.sendall(json.dumps({"error": repr(exc)}).encode() + b"\n")


if __name__ == "__main__":
    try:
        serve(sys.argv[1], sys.argv[2])
    finally:
        shutil.rmtree(os.path.dirname(sys.argv[2]), ignore_errors=True)
