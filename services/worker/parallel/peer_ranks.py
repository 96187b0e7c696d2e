"""Rank 0's side of a parallel worker: it starts the other ranks as processes of their own
(`python -m services.worker.parallel.peer`, the worker's settings as flags), joins the
process group with them, sends each of them every step and reset over a pipe, and watches
them: a rank that exits takes the whole worker down (its requests recompute elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from common.config import config_argv
from common.log import get_logger
from common.model_config import ModelConfig
from common.pb.tandem.internal.v1 import worker_pb2
from services.worker.config import WorkerConfig
from services.worker.parallel.rank_channel import RESET, STEP, write_message
from services.worker.parallel.rank_context import RankContext, join_group, master_store

log = get_logger(__name__)


class PeerRanks:
    def __init__(self, config: WorkerConfig, store_port: int) -> None:
        self.world_size = config.world_size
        self._closing = False
        self._pipes: list[int] = []
        self._procs: list[subprocess.Popen] = []
        self.store = None
        for rank in range(1, self.world_size):
            read_fd, write_fd = os.pipe()
            command = [
                sys.executable, "-m", "services.worker.parallel.peer",
                "--rank", str(rank), "--store-port", str(store_port), "--step-fd", str(read_fd),
                *config_argv(config),
            ]  # fmt: skip
            self._procs.append(subprocess.Popen(command, pass_fds=(read_fd,)))
            os.close(read_fd)
            self._pipes.append(write_fd)
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"rank-{rank}-watch", daemon=True
            ).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            log.error("rank_exited", rank=rank, returncode=code, action="stopping the worker")
            os._exit(1)  # the group cannot go on: the scheduler fails this worker

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
