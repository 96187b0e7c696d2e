"""One rank's place in a parallel worker: joining the group (`torch.distributed` over a
TCP store rank 0 owns: gloo on CPU, NCCL on GPU), its device, its tensor-parallel group
(the ranks of its pipeline stage), its pipeline stage, and how the ranks that do not sample
learn the step's tokens: `TokenShare` (one stage: rank 0 samples and broadcasts them) or
`OutputShare` (several stages: the last stage samples and broadcasts the step's output).
Rank = stage x tensor_parallel_size + tensor rank (vLLM's order)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.kv_shared_memory import SharedMemoryInfo, shared_memory_from_pb, shared_memory_to_pb
from common.parallel_plan import Layout
from common.pb.tandem.internal.v1 import worker_pb2
from services.worker.parallel.output_share import OutputShare
from services.worker.sharding.pipeline_stage import PipelineStage
from services.worker.sharding.tp_group import TpGroup

STORE_HOST = "127.0.0.1"  # all ranks of a worker run on its host
# A collective that waits this long means a rank is gone or stuck: it fails the step.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


class TokenShare:
    """Rank 0 samples; it sends each step's tokens to the other ranks, which keep their
    copies of the batch (the next step's inputs) in step. Over gloo, on the host."""

    pipeline = False

    def __init__(self, rank: int, group) -> None:
        self.rank = rank
        self.group = group

    @property
    def samples(self) -> bool:
        return self.rank == 0

    def send(self, tokens: list[int]) -> None:
        dist.broadcast(torch.tensor(tokens, dtype=torch.int64), src=0, group=self.group)

    def receive(self, count: int) -> list[int]:
        tokens = torch.empty(count, dtype=torch.int64)
        dist.broadcast(tokens, src=0, group=self.group)
        return tokens.tolist()


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    tp: TpGroup
    tokens: TokenShare | OutputShare
    host_group: object = None  # gloo collectives on host tensors (None: the default group)
    store: object = None  # the group's TCP store (rank 0 owns it)
    stage: PipelineStage = PipelineStage()

    def publish_pool(self, info: SharedMemoryInfo | None) -> None:
        """A peer rank tells rank 0 where its KV pool's shared memory is (empty: none)."""
        data = b"" if info is None else shared_memory_to_pb(info).SerializeToString()
        self.store.set(f"kv_pool/{self.rank}", data)

    def collect_pools(self) -> list[SharedMemoryInfo | None]:
        """Rank 0: every other rank's published pool, in rank order (waits for them)."""
        out = []
        for rank in range(1, self.world_size):
            data = self.store.get(f"kv_pool/{rank}")
            out.append(shared_memory_from_pb(worker_pb2.KvSharedMemory.FromString(data))
                       if data else None)  # fmt: skip
        return out

    def publish_ucx_address(self, address: bytes) -> None:
        """A peer rank tells rank 0 its UCX worker's address (KV moves rank to rank)."""
        self.store.set(f"ucx/{self.rank}", address)

    def collect_ucx_addresses(self) -> list[bytes]:
        """Rank 0: every other rank's UCX address, in rank order (waits for them)."""
        return [bytes(self.store.get(f"ucx/{rank}")) for rank in range(1, self.world_size)]

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` any rank has (every rank calls it): e.g. the pool size all
        ranks can hold, so that block ids mean the same blocks on every rank."""
        out = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(out, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(out.item())

    def all_min(self, values: list[int]) -> list[int]:
        """Each position's smallest value over the ranks (every rank calls it, with as many
        values): e.g. which disk reads succeeded on every rank."""
        if not values:
            return []
        out = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(out, op=dist.ReduceOp.MIN, group=self.host_group)
        return out.tolist()


def rank_device(name: str, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the configured one; the CPU for everyone on CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    first = device.index or 0
    if first + rank >= torch.cuda.device_count():
        raise ValueError(
            f"rank {rank} needs cuda:{first + rank} but {torch.cuda.device_count()} GPU(s) "
            f"are visible"
        )
    return torch.device("cuda", first + rank)


def master_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free port (peers connect to `store.port`)."""
    return dist.TCPStore(
        STORE_HOST, 0, world_size, is_master=True, wait_for_workers=False,
        timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip


def peer_store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def join_group(rank: int, layout: Layout, num_layers: int, store, device_name: str) -> RankContext:
    """Join the worker's process group (blocks until every rank has)."""
    world_size, tp_size = layout.world_size, layout.tp
    device = rank_device(device_name, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    host_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    stage = PipelineStage.of(layout, rank, num_layers)
    tp_group = None  # one stage: the default group
    if layout.pp > 1 and tp_size > 1:  # every rank creates every stage's group, in order
        groups = [dist.new_group([layout.rank(s, r) for r in range(tp_size)])
                  for s in range(layout.pp)]  # fmt: skip
        tp_group = groups[stage.stage]
    tokens: TokenShare | OutputShare = TokenShare(rank, host_group)
    if layout.pp > 1:
        tokens = OutputShare(rank, layout.rank(layout.pp - 1, 0), host_group)
    return RankContext(
        rank=rank,
        world_size=world_size,
        device=device,
        tp=TpGroup(rank=rank % tp_size, size=tp_size, group=tp_group),
        tokens=tokens,
        host_group=host_group,
        store=store,
        stage=stage,
    )
