"""How a pipeline-parallel worker's ranks learn a step's results: the last stage's tensor
rank 0 samples (it alone has the logits), then broadcasts the whole step output — tokens,
logprobs, prompt logprobs, as the `StepResponse` protobuf, never pickle — to every other
rank: rank 0 answers the scheduler with it, and every rank keeps its copy of the batch (the
next step's inputs) in step. Over gloo, on the host."""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.pb.tandem.internal.v1 import worker_pb2
from common.step_result import StepResult
from common.step_result_pb import result_from_pb, result_to_pb


class OutputShare:
    pipeline = True

    def __init__(self, rank: int, sampler_rank: int, group) -> None:
        self.rank = rank
        self.sampler_rank = sampler_rank
        self.group = group

    @property
    def samples(self) -> bool:
        return self.rank == self.sampler_rank

    def send_output(self, output: StepResult) -> None:
        data = result_to_pb(output).SerializeToString()
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=self.sampler_rank, group=self.group)
        if data:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(payload, src=self.sampler_rank, group=self.group)

    def receive_output(self) -> StepResult:
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=self.sampler_rank, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        if payload.numel():
            dist.broadcast(payload, src=self.sampler_rank, group=self.group)
        return result_from_pb(worker_pb2.StepResponse.FromString(payload.numpy().tobytes()))
