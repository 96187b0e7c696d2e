"""Fork servers for stacks started by tests and benchmarks: one process per service
imports what that service imports (a worker: torch, ~2.8 of its ~3.4 s; the gateway: its
tokenizer's `transformers`, ~1.8 s) once, then forks each new process of that service from
that state instead of starting a fresh interpreter that imports it all again. The forked
child becomes the service exactly as `python -m services.<name> ARGS` would: its own
session, working directory, environment and log file.

Only what cannot differ between children is shared. The server serves a start only when
the child's environment agrees with its own on every variable read while modules are
imported (OpenMP, MKL, torch, Triton, the loader, Python, gRPC, UCX, Hugging Face:
`common.fork_protocol.IMPORT_TIME_PREFIXES`);
otherwise the caller starts the process as usual. The server reaps its children and keeps
their exit codes, so the caller can still ask how a worker ended. It exits when the process
that started it is gone, and its children, started with `TANDEM_EXIT_WITH_PARENT=1`, follow.

The protocol and its client side: `common/fork_protocol.py`.
"""

from __future__ import annotations

import fcntl
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

from common.fork_protocol import (
    RANK_MODULE,
    ForkServerConnection,
    import_time_env,
)


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
    RANK_MODULE: (RANK_MODULE,),  # a worker's tensor- and pipeline-parallel ranks
}
_BEFORE_PRELOAD = {"services.gateway": _keep_torch_out}


_PARENT_POLL_S = 0.5


class ForkServerClient(ForkServerConnection):
    """The starting side: launches the server process and asks it for children."""

    def __init__(
        self, module: str, env: Mapping[str, str], cwd: str, ready_timeout_s: float = 120.0
    ):
        if module not in PRELOADS:
            raise ValueError(f"no fork server for {module!r}; there are: {sorted(PRELOADS)}")
        self.env = dict(env)
        self.directory = Path(tempfile.mkdtemp(prefix="tandem-fork-"))
        super().__init__(module, str(self.directory / "server.sock"))
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
    except (OSError, RuntimeError) as exc:  # ForkServerError is a RuntimeError
        print(f"tandem: no fork server ({exc}); starting processes directly", file=sys.stderr)
        return None
    _shared[key] = server
    return server


# --- the server process ------------------------------------------------------------------

_exit_codes: dict[int, int | None] = {}
# Variables the preloaded modules set for themselves at import (`os.environ.setdefault`):
# a fresh interpreter would set them too, so every child gets them where its env has none.
_set_by_imports: dict[str, str] = {}
_signature: dict[str, str] = {}  # this server's import-time environment


def _reap(*_: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _exit_codes[pid] = os.waitstatus_to_exitcode(status)


def _become_child(request: dict, fds: list[int]) -> None:
    """In the forked child: turn into `python -m MODULE ARGS`; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request.get("new_session", True):
            os.setsid()
        if request.get("netns"):
            from common.netns import enter_netns

            enter_netns(request["netns"])
        os.chdir(request["cwd"])
        _inherit(dict(zip(request.get("fds", []), fds, strict=True)), request.get("log"))
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


def _inherit(fds: dict[int, int], log: str | None) -> None:
    """Give the child its descriptors: `fds` (its number -> the one received), stdout and
    stderr to `log` unless given, stdin from /dev/null unless given."""
    if log is not None:
        fds.setdefault(1, os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
        fds.setdefault(2, fds[1])
    fds.setdefault(0, os.open(os.devnull, os.O_RDONLY))
    # Out of the way of every target number first, then into place.
    moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for target, fd in fds.items()}
    for fd in set(fds.values()):
        if fd not in fds:
            os.close(fd)
    for target, fd in moved.items():
        os.dup2(fd, target)  # inheritable, as Popen's pass_fds leaves them
        os.close(fd)


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
    _, fds, _, _ = socket.recv_fds(conn, 1, 16)
    try:
        _answer(conn, listener, module, fds)
    finally:
        for fd in fds:  # the child has its copies; ours would keep pipes from ending
            os.close(fd)


def _differing(env: Mapping[str, str]) -> list[str]:
    """The import-time variables whose values in `env` (with what the preload sets where
    `env` has nothing) are not this server's."""
    child = import_time_env({**_set_by_imports, **env})
    return sorted(k for k in child.keys() | _signature.keys() if child.get(k) != _signature.get(k))


def _answer(conn: socket.socket, listener: socket.socket, module: str, fds: list[int]) -> None:
    request = json.loads(conn.makefile("rb").readline())
    if request["op"] == "spawn":
        if request["module"] != module:
            raise ValueError(f"module {request['module']!r} is not served here ({module} is)")
        differ = _differing(request["env"])
        if differ:
            raise ValueError(f"the child's import-time environment differs here: {differ}")
        pid = os.fork()
        if pid == 0:
            conn.close()
            listener.close()
            _become_child(request, fds)
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
    sys.modules.pop(PRELOADS[module][0], None)
    _set_by_imports.update((k, v) for k, v in os.environ.items() if before.get(k) != v)
    _signature.update(import_time_env(os.environ))
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
