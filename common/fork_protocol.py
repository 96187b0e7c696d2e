"""Asking a fork server (`services/stack/fork_server.py`) for a process: the protocol's
client side, shared by the stack launcher and by workers that start their tensor- and
pipeline-parallel ranks through one (`TANDEM_RANK_FORK_SERVER`), and `ForkedProcess`, the
`subprocess.Popen`-like handle of such a child (it is the server's child, not ours, so its
exit code comes from the server).

Protocol: per request, one connection on the server's Unix socket; one marker byte carrying
the file descriptors the child is to inherit (SCM_RIGHTS), one JSON line, one JSON reply.
  {"op": "spawn", "module": M, "args": [...], "env": {...}, "cwd": D, "log": F | null,
   "fds": [child fd numbers, in the order the descriptors were sent], "new_session": bool}
     -> {"pid": N}
  {"op": "exit_code", "pid": N} -> {"known": bool, "exit_code": int | null (still running)}
  any refusal -> {"error": "..."}
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping

# Variables that libraries read when they are loaded (so a forked child could not change
# them): a server refuses a child whose values differ from its own.
IMPORT_TIME_PREFIXES = (
    "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH_",
    "TRITON_", "CUDA_", "NVIDIA_", "LD_", "MALLOC_", "PYTHON", "GRPC_", "UCX", "THP_",
    "HF_", "TRANSFORMERS_", "TOKENIZERS_",
)  # fmt: skip
RANK_SERVER_ENV = "TANDEM_RANK_FORK_SERVER"  # a worker's ranks' server (its socket path)
RANK_MODULE = "services.worker.parallel.peer"


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of `env` that modules read while they are imported."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


class ForkServerError(RuntimeError):
    """The server refused or did not answer; the caller starts the process itself."""


class ForkServerConnection:
    """A running server for `module`, reached at `socket_path`."""

    def __init__(self, module: str, socket_path: str) -> None:
        self.module = module
        self.socket_path = socket_path

    def spawn(
        self,
        module: str,
        args: list[str],
        env: Mapping[str, str],
        cwd: str,
        log: str | None = None,
        fds: Mapping[int, int] | None = None,
        new_session: bool = True,
        netns: str | None = None,
    ) -> int:
        """Start `python -m module args`; `fds`: the child's fd number -> our descriptor
        it gets (1 and 2 there replace `log`); `netns`: the network namespace it runs in
        (one made by `ip netns add`; None: the server's)."""
        fds = dict(fds or {})
        request = {
            "op": "spawn", "module": module, "args": list(args), "env": dict(env), "cwd": cwd,
            "log": log, "fds": list(fds), "new_session": new_session, "netns": netns,
        }  # fmt: skip
        return int(self._ask(request, list(fds.values()))["pid"])

    def exit_code(self, pid: int) -> tuple[bool, int | None]:
        """(whether `pid` is this server's child, its exit code or None while it runs)."""
        reply = self._ask({"op": "exit_code", "pid": pid})
        return bool(reply["known"]), reply["exit_code"]

    def _ask(self, request: dict, fds: list[int] = ()) -> dict:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30)
                sock.connect(self.socket_path)
                socket.send_fds(sock, [b"\0"], list(fds))
                sock.sendall(json.dumps(request).encode() + b"\n")
                reply = sock.makefile("rb").readline()
        except OSError as exc:
            raise ForkServerError(f"fork server at {self.socket_path}: {exc}") from exc
        if not reply:
            raise ForkServerError(f"fork server at {self.socket_path} gave no reply")
        answer = json.loads(reply)
        if "error" in answer:
            raise ForkServerError(f"fork server refused {request['op']}: {answer['error']}")
        return answer


class ForkedProcess:
    """What a caller needs of a `subprocess.Popen` for a fork server's child."""

    def __init__(self, server: ForkServerConnection, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                known, code = self.server.exit_code(self.pid)
            except ForkServerError:  # the server is gone (the session ends): ask the OS
                known, code = True, None if _exists(self.pid) else -1
            if not known:
                raise ForkServerError(f"the fork server does not know process {self.pid}")
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: it exists, as another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
