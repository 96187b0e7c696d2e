"""A worker's LoRA adapters: those held in memory (at most `max_cpu_loras`), the
`max_loras` slots of the model's batched LoRA layers, and per forward pass which slot each
token uses. A pass brings its adapters into slots first, evicting the least recently used
ones it does not need (the scheduler never puts more than `max_loras` in one step)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.worker.lora.adapter import LoraAdapter
from services.worker.lora.layers import LoraContext, install_lora


class LoraManager:
    def __init__(self, model, max_loras: int, max_rank: int, max_cpu_loras: int = 0) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.context = LoraContext()
        self._layers = install_lora(model, self.context, max_loras, max_rank)
        self._held: dict[str, LoraAdapter] = {}
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first

    @property
    def names(self) -> list[str]:
        return sorted(self._held)

    def register(self, adapter: LoraAdapter) -> None:
        """Hold the adapter (replacing one of the same name, in its slot too)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank} > "
                             f"max_lora_rank {self.max_rank}")  # fmt: skip
        if adapter.name not in self._held and len(self._held) >= self.max_cpu_loras:
            raise ValueError(f"{self.max_cpu_loras} LoRA adapters are loaded already "
                             "(--max-cpu-loras)")  # fmt: skip
        self._held[adapter.name] = adapter
        slot = self._slots.get(adapter.name)
        if slot is not None:
            self._fill(slot, adapter)

    def set_pass(self, token_adapters: Sequence[str | None], device="cpu") -> None:
        """The adapter of every token of the next forward pass (None or "": the base)."""
        wanted = list(dict.fromkeys(name for name in token_adapters if name))
        self._activate(wanted)
        slots = [self._slots[name] if name else -1 for name in token_adapters]
        self.context.set(slots, device)

    def clear_pass(self) -> None:
        self.context.clear()

    def _activate(self, names: list[str]) -> None:
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} LoRA adapters in one step; --max-loras is "
                             f"{self.max_loras}")  # fmt: skip
        for name in names:
            if name not in self._held:
                raise KeyError(f"LoRA adapter {name!r} is not loaded")
        for name in names:
            if name in self._slots:
                self._slots.move_to_end(name)
                continue
            taken = set(self._slots.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:  # evict the least recently used adapter this pass does not use
                victim = next(n for n in self._slots if n not in names)
                slot = self._slots.pop(victim)
            self._fill(slot, self._held[name])
            self._slots[name] = slot

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        for layer, lora in self._layers:
            lora.set_slot(slot, adapter, layer)
