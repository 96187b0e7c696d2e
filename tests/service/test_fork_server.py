"""The fork servers that test stacks start their services from (services/stack/fork_server.py):
a forked child is the process `python -m services.<name>` would be (its own session, the env
and log it was given; a gateway without torch), the server reports how each child ended,
refuses what it cannot start faithfully, and ends with the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.fork_protocol import ForkServerError, import_time_env
from services.stack.fork_server import ForkServerClient
from services.stack.launcher import ROOT
from services.stack.ports import free_port

WORKER = "services.worker"


@pytest.fixture(scope="module")
def server() -> ForkServerClient:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    client = ForkServerClient(WORKER, env, str(ROOT))
    yield client
    client.process.kill()
    client.process.wait()


def _wait_exit_code(server: ForkServerClient, pid: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        known, code = server.exit_code(pid)
        assert known, f"the server does not know its child {pid}"
        if code is not None:
            return code
        time.sleep(0.05)
    raise TimeoutError(f"child {pid} still running")


def _wait_for_line(log: Path, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} not in {log}:\n{log.read_text()}"
        time.sleep(0.05)


def test_a_child_gets_its_env_and_log_and_its_exit_code_is_reported(server, tmp_path):
    log = tmp_path / "bad-role.log"
    env = {**server.env, "TANDEM_MODEL": "/nowhere", "TANDEM_WORKER_ROLE": "painter"}
    pid = server.spawn(WORKER, ["--port", str(free_port())], env, str(ROOT), str(log))
    assert _wait_exit_code(server, pid) == 2  # the config's refusal, as from a fresh process
    text = log.read_text()
    assert "configuration error: TANDEM_WORKER_ROLE" in text and "'painter'" in text, text
    assert "RuntimeWarning" not in text, text  # runpy ran the module afresh, cleanly


def test_a_child_inherits_the_descriptors_it_is_given_and_only_it_holds_them(server):
    """What a worker's ranks need (their step and answer pipes, the worker's log): the
    child writes to the pipe it was given, and the pipe ends once the child has exited,
    so neither the server nor anyone else kept a copy of its write end."""
    read_end, write_end = os.pipe()
    env = {**server.env, "TANDEM_MODEL": "/nowhere", "TANDEM_WORKER_ROLE": "painter"}
    try:
        pid = server.spawn(WORKER, ["--port", str(free_port())], env, str(ROOT),
                           fds={1: write_end, 2: write_end}, new_session=False)  # fmt: skip
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()  # returns at end of file: every write end is closed
    assert "configuration error: TANDEM_WORKER_ROLE" in text, text
    assert _wait_exit_code(server, pid) == 2
    with pytest.raises(ForkServerError, match="import-time environment differs"):
        server.spawn(
            WORKER,
            [],
            {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "") + "7"},
            str(ROOT),
            os.devnull,
        )


def test_a_forked_worker_serves_in_its_own_session_and_dies_by_signal(
    server, tmp_path, tiny_llama_dir
):
    log = tmp_path / "worker.log"
    args = ["--model", str(tiny_llama_dir), "--role", "decode", "--port", str(free_port()),
            "--num-blocks", "64"]  # fmt: skip
    pid = server.spawn(WORKER, args, server.env, str(ROOT), str(log))
    _wait_for_line(log, '"serving"')
    assert os.getsid(pid) == pid  # its own session, as `start_new_session` gives
    assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == (
        server.process.pid
    )  # its parent: the server, which reaps it
    assert server.exit_code(pid) == (True, None)
    os.kill(pid, signal.SIGKILL)
    assert _wait_exit_code(server, pid) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):  # reaped, no zombie left
        os.kill(pid, 0)


def test_what_cannot_be_forked_faithfully_is_refused_naming_why(server, tmp_path):
    for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "PYTHONHASHSEED", "TRITON_INTERPRET"):
        changed = {**server.env, name: server.env.get(name, "") + "7"}
        with pytest.raises(ForkServerError, match=rf"differs here: \['{name}'\]"):
            server.spawn(WORKER, [], changed, str(ROOT), str(tmp_path / "never.log"))
    assert not (tmp_path / "never.log").exists()  # refused before any fork
    assert import_time_env({"OMP_X": "1", "TANDEM_Y": "2"}) == {"OMP_X": "1"}
    with pytest.raises(ForkServerError, match="not served"):  # one service per server
        server.spawn("services.gateway", [], server.env, str(ROOT), os.devnull)


def test_a_forked_gateway_runs_without_torch_as_a_fresh_one_does(server, tmp_path, tiny_llama_dir):
    gateway = ForkServerClient("services.gateway", server.env, str(ROOT))
    try:
        log = tmp_path / "gateway.log"
        args = ["--model", str(tiny_llama_dir), "--port", str(free_port()),
                "--scheduler", f"127.0.0.1:{free_port()}"]  # fmt: skip
        pid = gateway.spawn("services.gateway", args, server.env, str(ROOT), str(log))
        _wait_for_line(log, '"listening"')
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps  # its server marked torch absent, as its main does
        os.kill(pid, signal.SIGKILL)
        assert _wait_exit_code(gateway, pid) == -signal.SIGKILL
    finally:
        gateway.process.kill()
        gateway.process.wait()
    with pytest.raises(ValueError, match="no fork server"):
        ForkServerClient("services.client", server.env, str(ROOT))


def test_the_server_ends_with_the_process_that_started_it():
    code = (
        "import os, sys\n"
        "from services.stack.fork_server import ForkServerClient\n"
        "env = {**os.environ, 'PYTHONPATH': sys.argv[1]}\n"
        "client = ForkServerClient('services.scheduler', env, sys.argv[1])\n"
        "print(client.process.pid, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    server_pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server_pid}").exists() and _state(server_pid) != "Z":
        assert time.monotonic() < deadline, "the fork server outlived its parent"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
