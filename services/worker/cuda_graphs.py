"""Decode steps replayed from CUDA graphs: one graph per bucketed batch size.

A decode step (every sequence has exactly one new token) has the same shape from step to
step, so its whole forward pass — a few hundred kernel launches — is captured once per
bucket size and replayed with one launch. Inputs go through static buffers at fixed
addresses: each step copies its token ids, positions, rope lengths, slots, block tables and
sequence lengths into the first `n` rows of the smallest bucket `b >= n`, and pads rows
`n..b` so they do no harm (slot -1: nothing written; sequence length 1 over block 0: a
valid read whose result is dropped). Batches larger than the largest bucket, and any step
with a prompt chunk, run eagerly. The attention metadata handed to the captured model
carries static bounds (`max_seq_len` = the context length), so the kernels' launch grids
never change.

Without CUDA (or with `capture=False`) the same static-buffer path runs eagerly: that is
how the padding logic is tested on CPU.
"""

from __future__ import annotations

import torch

from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import AttentionMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Bucket sizes up to `max_batch_size` (which is always one of them)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {b for b in DEFAULT_BUCKETS if b < max_batch_size} | {max_batch_size}
    return tuple(sorted(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KvCache,
        buckets: tuple[int, ...],
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = buckets
        self.max_batch_size = buckets[-1]
        self.max_model_len = max_model_len
        self.capture = capture and kv_cache.device.type == "cuda"
        device = kv_cache.device
        n = self.max_batch_size
        max_blocks = -(-max_model_len // kv_cache.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.rope_lengths = torch.ones(n, dtype=torch.long, device=device)  # length-dependent RoPE
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def supports(self, meta: AttentionMetadata) -> bool:
        return meta.is_pure_decode and len(meta.seq_lens) <= self.max_batch_size

    def _meta(self, batch: int, host_seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            query_start_loc=list(range(batch + 1)),
            seq_lens=host_seq_lens,
            block_size=self.kv_cache.block_size,
            query_start_loc_t=self.query_start_loc[: batch + 1],
            seq_lens_t=self.seq_lens[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            rope_lengths=self.rope_lengths[:batch],
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (its memory is reused by the smaller ones)."""
        if not self.capture:
            return
        for batch in reversed(self.buckets):
            self._reset_padding(0, batch)
            meta = self._meta(batch, [1] * batch)
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_cache, meta)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up: allocations, autotuning, lazy init
                for _ in range(2):
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.model(*args)
            self._graphs[batch] = (graph, output)
        torch.cuda.synchronize()

    def _reset_padding(self, start: int, end: int) -> None:
        if end > start:
            self.input_ids[start:end] = 0
            self.positions[start:end] = 0
            self.rope_lengths[start:end] = 1
            self.slot_mapping[start:end] = -1
            self.seq_lens[start:end] = 1
            self.block_tables[start:end] = 0

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states `[n, hidden]` of a pure-decode step of n <= max_batch_size rows."""
        n = input_ids.shape[0]
        batch = self.bucket_for(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.rope_lengths[:n].copy_(
            positions + 1 if meta.rope_lengths is None else meta.rope_lengths
        )
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens_t)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self._reset_padding(n, batch)
        if batch in self._graphs:
            graph, output = self._graphs[batch]
            self.kv_cache.all_layers_needed()  # the graph runs no Python per layer
            graph.replay()
            return output[:n]
        padded = self._meta(batch, list(meta.seq_lens) + [1] * (batch - n))
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_cache, padded)
        return hidden[:n]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def graph_for(self, num_seqs: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph a step of `num_seqs` rows replays (None: runs eagerly);
        `bench.gpu` times its replay alone to split a step's time."""
        entry = self._graphs.get(self.bucket_for(num_seqs))
        return None if entry is None else entry[0]
