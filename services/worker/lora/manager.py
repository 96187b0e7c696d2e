"""A worker's loaded LoRA adapters: which slot each occupies in the model's batched LoRA
layers (at most `max_loras`), and, per forward pass, which slot each token uses."""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.lora.adapter import LoraAdapter
from services.worker.lora.layers import LoraContext, install_lora


class LoraManager:
    def __init__(self, model, max_loras: int, max_rank: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.context = LoraContext()
        self._layers = install_lora(model, self.context, max_loras, max_rank)
        self._slots: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._slots)

    def add(self, adapter: LoraAdapter) -> int:
        """Put the adapter in a free slot (replacing one of the same name); its slot."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank} > "
                             f"max_lora_rank {self.max_rank}")  # fmt: skip
        slot = self._slots.get(adapter.name)
        if slot is None:
            free = sorted(set(range(self.max_loras)) - set(self._slots.values()))
            if not free:
                raise ValueError(f"all {self.max_loras} LoRA slots are taken (--max-loras)")
            slot = free[0]
        for layer, lora in self._layers:
            lora.set_slot(slot, adapter, layer)
        self._slots[adapter.name] = slot
        return slot

    def remove(self, name: str) -> None:
        slot = self._slots.pop(name)
        for layer, lora in self._layers:
            lora.set_slot(slot, None, layer)

    def slot(self, name: str | None) -> int:
        """-1 for the base model (None or "")."""
        if not name:
            return -1
        if name not in self._slots:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        return self._slots[name]

    def set_pass(self, token_adapters: Sequence[str | None], device="cpu") -> None:
        """The adapter of every token of the next forward pass (None: the base model)."""
        self.context.set([self.slot(name) for name in token_adapters], device)

    def clear_pass(self) -> None:
        self.context.clear()
