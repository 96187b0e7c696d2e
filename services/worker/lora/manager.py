"""A worker's LoRA adapters: those it serves (name -> folder), those held in memory (at
most `max_cpu_loras`, least recently used evicted and read again from their folder when a
step needs them, as vLLM's CPU LoRA cache does), the `max_loras` slots of the model's
batched LoRA layers, and per forward pass which slot each token uses. A pass brings its
adapters into slots first, evicting the least recently used ones it does not need (the
scheduler never puts more than `max_loras` in one step).

Adapters are added at start (--lora-modules) and at run time (`add` / `remove`, from the
AddLora / RemoveLora RPCs); every call runs on the worker's tensor thread, so none races a
forward pass. An adapter registered without a folder (tests) cannot be read again and is
never evicted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from services.worker.lora.adapter import LoraAdapter
from services.worker.lora.layers import LoraContext, install_lora

AdapterLoader = Callable[[str, str], LoraAdapter]  # (name, folder) -> the checked adapter


class LoraManager:
    def __init__(
        self,
        model,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int = 0,
        load: AdapterLoader | None = None,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.context = LoraContext()
        self._load = load
        self._layers = install_lora(model, self.context, max_loras, max_rank)
        self._paths: dict[str, str] = {}  # every served adapter ("" = cannot be re-read)
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recent first
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first

    @property
    def names(self) -> list[str]:
        return sorted(self._paths)

    @property
    def held(self) -> list[str]:
        """The adapters in memory, least recently used first."""
        return list(self._held)

    def add(self, name: str, path: str) -> bool:
        """Serve the adapter in folder `path` as `name` (read and checked now: raises
        LoraAdapterError / ValueError saying why it cannot be applied). False when it is
        served already from that folder; a name served from another folder is replaced."""
        if self._load is None:
            raise ValueError("this LoRA manager cannot read adapter folders")
        if self._paths.get(name) == path:
            return False
        self.register(self._load(name, path), path)
        return True

    def register(self, adapter: LoraAdapter, path: str = "") -> None:
        """Serve and hold `adapter` (replacing one of the same name, in its slot too)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank} > "
                             f"max_lora_rank {self.max_rank}")  # fmt: skip
        if not path and not self._evictable(adapter.name):
            raise ValueError(f"{self.max_cpu_loras} LoRA adapters are loaded already "
                             "(--max-cpu-loras)")  # fmt: skip
        self._paths[adapter.name] = path
        self._hold(adapter)
        slot = self._slots.get(adapter.name)
        if slot is not None:
            self._fill(slot, adapter)

    def remove(self, name: str) -> bool:
        """Stop serving `name` (False if it was not served). Its slot is free for the next
        adapter (no token maps to it meanwhile)."""
        if self._paths.pop(name, None) is None:
            return False
        self._held.pop(name, None)
        self._slots.pop(name, None)
        return True

    def set_pass(self, token_adapters: Sequence[str | None], device="cpu") -> None:
        """The adapter of every token of the next forward pass (None or "": the base)."""
        wanted = list(dict.fromkeys(name for name in token_adapters if name))
        self._activate(wanted)
        slots = [self._slots[name] if name else -1 for name in token_adapters]
        self.context.set(slots, device)

    def clear_pass(self) -> None:
        self.context.clear()

    def _evictable(self, adding: str) -> bool:
        """Holding one more adapter than now stays within max_cpu_loras, evicting if need
        be (only adapters that can be read again are evicted)."""
        if adding in self._held or len(self._held) < self.max_cpu_loras:
            return True
        return any(self._paths.get(n) for n in self._held)

    def _hold(self, adapter: LoraAdapter) -> None:
        self._held[adapter.name] = adapter
        self._held.move_to_end(adapter.name)
        while len(self._held) > self.max_cpu_loras:
            victim = next((n for n in self._held if self._paths.get(n)), None)
            if victim is None or victim == adapter.name:
                break
            del self._held[victim]

    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self._held.get(name)
        if adapter is None:  # evicted from memory: read its folder again
            adapter = self._load(name, self._paths[name])
            self._hold(adapter)
        else:
            self._held.move_to_end(name)
        return adapter

    def _activate(self, names: list[str]) -> None:
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} LoRA adapters in one step; --max-loras is "
                             f"{self.max_loras}")  # fmt: skip
        for name in names:
            if name not in self._paths:
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
            self._fill(slot, self._adapter(name))
            self._slots[name] = slot

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        for layer, lora in self._layers:
            lora.set_slot(slot, adapter, layer)
