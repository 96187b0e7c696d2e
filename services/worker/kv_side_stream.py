"""The offload tier's copies beside a GPU: between the CUDA pool and its page-locked host
tier, on a CUDA stream of their own, ordered against the compute stream with events only
(the host never waits, except before it touches offload blocks itself).

- Saves (pool -> tier, after a forward pass): one copy per run of consecutive blocks; the
  compute stream waits for them only before the next step writes (`before_step`).
- Loads (tier -> pool, before a forward pass), layer by layer: for each layer slot, in the
  order the pass reads them, one pitched copy per run of consecutive blocks
  (`cuda_pitched_copy`), then an event. `wait_for_layer(i)`, called before layer i's
  attention, makes the compute stream wait for layer i's event alone, so the first
  layers compute while later ones still copy. A pass that reads every layer at once (a
  replayed CUDA graph) waits for each first (`KvCache.all_layers_needed`), and after the
  pass (`finish_loads`) the compute stream waits for whatever no layer waited for, so
  nothing later can read a block still being loaded.
- Whole-block loads (no pitched copy available, or a copy-on-write copy in the same step
  reads a loaded block before the pass): one copy per run, and the compute stream waits
  for all of them at once.

Events only order work on the device; a stream's `wait_event` covers the work queued on
the other stream before the event was recorded, whatever happens after.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.cuda_pitched_copy import PitchedCopy
from services.worker.kv_cache import KvCache, block_runs


def slot_order(layer_slots: Sequence[tuple[int, int]], num_slots: int) -> list[int]:
    """Every slot of a block, those the layers read in the order they read them first."""
    order = list(dict.fromkeys(slot for _, slot in layer_slots))
    return order + [slot for slot in range(num_slots) if slot not in order]


def slot_rows(cache: KvCache) -> torch.Tensor:
    """The pool as `[blocks, slots, slot bytes]` uint8: a slot of a run of blocks is rows
    of one width, a block apart."""
    return cache.bytes.view(cache.num_blocks, cache.num_layers, -1)


class SideStream:
    """Copies between a CUDA pool and its page-locked tier on a stream of their own."""

    def __init__(self, device: torch.device, pitched: PitchedCopy | None = None) -> None:
        """`pitched`: the strided copy layer-wise loads use (None: whole-block loads)."""
        self.stream = torch.cuda.Stream(device)
        self.pitched = pitched
        self.saved: torch.cuda.Event | None = None  # the last saves queued
        self.last: torch.cuda.Event | None = None  # the last copies of either kind queued
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        # Per layer of the pass, its slot's event not yet waited for (None: waited), and
        # the event after the last slot's copies.
        self._layers: list[torch.cuda.Event | None] | None = None
        self._loads_end: torch.cuda.Event | None = None

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.stream.device)

    def copy(self, dst: KvCache, src: KvCache, pairs: Sequence[tuple[int, int]]) -> None:
        """`dst[d] = src[s]` for each (s, d), whole blocks, queued on the side stream after
        what the compute stream queued so far."""
        self.stream.wait_stream(self._compute())
        with torch.cuda.stream(self.stream):
            runs = block_runs([p[0] for p in pairs], [p[1] for p in pairs])
            for s, d, n in runs:
                dst.bytes[d : d + n].copy_(src.bytes[s : s + n], non_blocking=True)

    def _timed(self) -> torch.cuda.Event:
        start = torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        return start

    def _loaded(self, start: torch.cuda.Event) -> torch.cuda.Event:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self.last, self._timing = end, (start, end)
        return end

    def loads(self, dst: KvCache, src: KvCache, pairs) -> None:
        """Whole-block loads, timed on the device; the compute stream waits for them all."""
        self.finish_loads()
        start = self._timed()
        self.copy(dst, src, pairs)
        self._compute().wait_event(self._loaded(start))

    def layer_loads(self, dst: KvCache, src: KvCache, pairs) -> None:
        """Loads slot by slot, timed on the device, an event after each slot's copies; the
        compute stream waits for none of them here (`wait_for_layer`)."""
        if self.pitched is None:
            raise RuntimeError("layer-wise loads need the CUDA runtime's pitched copy")
        self.finish_loads()
        self.stream.wait_stream(self._compute())  # earlier steps done with these blocks
        start = self._timed()
        runs = block_runs([p[0] for p in pairs], [p[1] for p in pairs])
        to, of = slot_rows(dst), slot_rows(src)
        events: dict[int, torch.cuda.Event] = {}
        with torch.cuda.stream(self.stream):
            for slot in slot_order(dst.layer_slots, dst.num_layers):
                for s, d, n in runs:
                    self.pitched(to[d : d + n, slot], of[s : s + n, slot], self.stream)
                events[slot] = self.stream.record_event()
        self._loads_end = self._loaded(start)
        self._layers = [events[slot] for _, slot in dst.layer_slots]

    def wait_for_layer(self, index: int) -> None:
        """Layer `index` of the pass is about to read the pool: the compute stream waits for
        its slot's loads (nothing when none are under way)."""
        if self._layers is not None and self._layers[index] is not None:
            self._compute().wait_event(self._layers[index])
            self._layers[index] = None

    def finish_loads(self) -> None:
        """The compute stream waits for the layer-wise loads no layer waited for."""
        if self._layers is not None:
            if any(event is not None for event in self._layers):
                self._compute().wait_event(self._loads_end)
            self._layers = self._loads_end = None

    def load_seconds(self) -> float | None:
        """How long the last loads took (once they are done: after the forward pass that
        waited for them); None when none were timed since the last call."""
        if self._timing is None:
            return None
        (start, end), self._timing = self._timing, None
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def saves(self, dst: KvCache, src: KvCache, pairs) -> None:
        self.copy(dst, src, pairs)
        self.saved = self.last = self.stream.record_event()

    def before_step(self) -> None:
        """A step may write blocks the last saves still read: the compute stream waits (and
        for any loads of an earlier step that no layer waited for)."""
        self.finish_loads()
        if self.saved is not None:
            self._compute().wait_event(self.saved)

    def before_host_access(self) -> None:
        """The CPU is about to read or write offload blocks: the copies queued must be done
        (saves write them, loads read them)."""
        if self.last is not None:
            self.last.synchronize()
