"""Rank 0's side of a parallel worker: it starts the other ranks as processes of their own
(`python -m services.worker.parallel.peer`, the worker's settings as flags), joins the
process group with them, sends each of them every step and reset over a pipe, commands
their parts of KV transfers over UCX and awaits their answers on a pipe back, and watches
them: a rank that exits takes the whole worker down (its requests recompute elsewhere)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

from common.config import config_argv
from common.fork_protocol import (
    RANK_MODULE,
    RANK_SERVER_ENV,
    ForkedProcess,
    ForkServerConnection,
    ForkServerError,
)
from common.log import get_logger
from common.model_config import ModelConfig
from common.pb.tandem.internal.v1 import worker_pb2
from services.worker.config import WorkerConfig
from services.worker.parallel.rank_channel import (
    ANSWER,
    RESET,
    STEP,
    read_messages,
    write_json,
    write_message,
)
from services.worker.parallel.rank_context import RankContext, join_group, master_store

log = get_logger(__name__)


class PeerRanks:
    def __init__(self, config: WorkerConfig, store_port: int) -> None:
        self.world_size = config.world_size
        self._closing = False
        self._pipes: list[int] = []
        self._procs: list[subprocess.Popen | ForkedProcess] = []
        self.answers = RankAnswers()
        self.store = None
        for rank in range(1, self.world_size):
            read_fd, write_fd = os.pipe()
            answer_read, answer_write = os.pipe()
            args = [
                "--rank", str(rank), "--store-port", str(store_port), "--step-fd", str(read_fd),
                "--answer-fd", str(answer_write), *config_argv(config),
            ]  # fmt: skip
            self._procs.append(_start_rank(args, (read_fd, answer_write)))
            os.close(read_fd)
            os.close(answer_write)
            self._pipes.append(write_fd)
            threading.Thread(
                target=self._read_answers, args=(rank, answer_read), name=f"rank-{rank}-answers",
                daemon=True,
            ).start()  # fmt: skip
        log.info("peer_ranks_started", pids=self.pids)
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"rank-{rank}-watch", daemon=True
            ).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _watch(self, rank: int, proc: subprocess.Popen | ForkedProcess) -> None:
        code = proc.wait()
        if not self._closing:
            log.error("rank_exited", rank=rank, returncode=code, action="stopping the worker")
            os._exit(1)  # the group cannot go on: the scheduler fails this worker

    def _read_answers(self, rank: int, fd: int) -> None:
        for kind, payload in read_messages(fd):
            if kind != ANSWER:
                continue
            body = json.loads(payload)
            self.answers.settle(rank, body["tag"], body["op"], body.get("error"))
        os.close(fd)

    def command(self, rank: int, kind: bytes, body: dict) -> None:
        """One KV transfer command to rank `rank` (1..), after whatever was written before."""
        write_json(self._pipes[rank - 1], kind, body)

    def send_step(self, plan: worker_pb2.StepRequest) -> None:
        payload = plan.SerializeToString()
        for fd in self._pipes:
            write_message(fd, STEP, payload)

    def reset(self) -> None:
        for fd in self._pipes:
            write_message(fd, RESET)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the peers (end of file on their pipes), killing those that do not exit."""
        self._closing = True
        for fd in self._pipes:
            os.close(fd)
        self._pipes = []
        for proc in self._procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start_rank(args: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen | ForkedProcess:
    """`python -m services.worker.parallel.peer ARGS` with these descriptors: forked by the
    fork server named in TANDEM_RANK_FORK_SERVER where there is one (test stacks: the
    rank's imports are ~3 s), else a fresh interpreter."""
    socket_path = os.environ.get(RANK_SERVER_ENV)
    if socket_path:
        server = ForkServerConnection(RANK_MODULE, socket_path)
        fds = {fd: fd for fd in (*pass_fds, 1, 2)}  # the rank logs where the worker does
        try:
            pid = server.spawn(RANK_MODULE, args, os.environ, os.getcwd(), fds=fds,
                               new_session=False)  # fmt: skip
            return ForkedProcess(server, pid)
        except ForkServerError as exc:
            log.warning("rank_fork_refused", error=str(exc), action="starting it directly")
    return subprocess.Popen([sys.executable, "-m", RANK_MODULE, *args], pass_fds=pass_fds)


class RankTransferError(RuntimeError):
    """A rank's part of a KV transfer failed."""


class RankAnswers:
    """The ranks' answers to their parts of KV transfers, awaited on the event loop."""

    def __init__(self) -> None:
        # (transfer tag, "sent" or "received", rank) -> its future, on the event loop
        self._expected: dict[tuple[int, str, int], asyncio.Future] = {}

    def expect(self, tag: int, op: str, rank: int) -> asyncio.Future:
        """A future for rank `rank`'s answer to its part of transfer `tag` (register it
        before commanding the part); it raises `RankTransferError` with the rank's error."""
        future = asyncio.get_running_loop().create_future()
        self._expected[(tag, op, rank)] = future
        return future

    def forget(self, tag: int) -> None:
        """Answers to transfer `tag` still to come are dropped."""
        for key in [k for k in self._expected if k[0] == tag]:
            self._expected.pop(key, None)

    def settle(self, rank: int, tag: int, op: str, error: str | None = None) -> None:
        """Rank `rank` answered (from any thread)."""
        future = self._expected.pop((tag, op, rank), None)
        if future is not None:
            future.get_loop().call_soon_threadsafe(_settle, future, rank, error)


def _settle(future: asyncio.Future, rank: int, error: str | None) -> None:
    if future.done():
        return
    if error:
        future.set_exception(RankTransferError(f"rank {rank}: {error}"))
    else:
        future.set_result(None)


def start_peer_ranks(config: WorkerConfig) -> tuple[PeerRanks, RankContext]:
    """Start ranks 1..N-1 and join the group as rank 0 (blocks until all have joined)."""
    store = master_store(config.world_size)
    peers = PeerRanks(config, store.port)
    try:
        num_layers = ModelConfig.from_folder(config.model).num_hidden_layers
        ranks = join_group(0, config.layout, num_layers, store, config.device)
    except BaseException:
        peers.close(timeout_s=1.0)
        raise
    peers.store = store  # rank 0's store lives as long as the group
    return peers, ranks
