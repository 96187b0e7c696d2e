"""A rank's pipeline stage: which decoder layers it holds (`common.parallel_plan.
layer_ranges`), whether it embeds the tokens (the first stage) or ends the model with the
final norm and the LM head (the last), and the hand-over of the hidden states between
stages: the rank of tensor rank r in stage s sends `[tokens, hidden]` to tensor rank r of
stage s + 1 (every tensor rank holds the whole hidden state after its all-reduces), with
point-to-point `torch.distributed` send/recv. Sends do not wait (the stage goes on with
its next micro-batch, `micro_batches.py`); `wait_sends` waits for them at the end
of the step. The default is the one stage of the whole model: nothing is sent."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.parallel_plan import Layout, layer_ranges


@dataclass(frozen=True)
class PipelineStage:
    stage: int = 0
    size: int = 1
    layers: range | None = None  # None: every layer of the model (one stage)
    prev_rank: int = -1  # the rank that sends this one its input (-1: first stage)
    next_rank: int = -1  # the rank this one sends its output to (-1: last stage)
    # sends under way: (work, tensor), the tensor kept alive until the send is done
    _sending: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.size:
            raise ValueError(f"pipeline stage {self.stage} outside size {self.size}")

    @classmethod
    def of(cls, layout: Layout, rank: int, num_layers: int) -> PipelineStage:
        stage, tp_rank = divmod(rank, layout.tp)
        return cls(
            stage,
            layout.pp,
            layer_ranges(num_layers, layout.pp)[stage],
            layout.rank(stage - 1, tp_rank) if stage > 0 else -1,
            layout.rank(stage + 1, tp_rank) if stage < layout.pp - 1 else -1,
        )

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else self.layers

    def receive_hidden(self, num_tokens: int, width: int, dtype, device) -> torch.Tensor:
        """The previous stage's hidden states for this step's `num_tokens` tokens."""
        hidden = torch.empty(num_tokens, width, dtype=dtype, device=device)
        dist.recv(hidden, src=self.prev_rank)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        hidden = hidden.contiguous()
        self._sending.append((dist.isend(hidden, dst=self.next_rank), hidden))

    def wait_sends(self) -> None:
        while self._sending:
            work, _ = self._sending.pop(0)
            work.wait()
