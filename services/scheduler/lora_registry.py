"""The LoRA adapters the scheduler serves, and the state of each run-time load or unload
(pure: no grpc, no I/O).

An adapter is served from the moment every worker holds it until an unload begins; new
requests may name only served adapters. A load in progress, or an unload waiting for the
adapter's running requests, keeps its name taken. Each run-time load gets a new
generation, which joins the adapter's name in the prefix-cache key: blocks computed with an
adapter are never reused by a later adapter loaded under the same name."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

STARTUP = "startup"
RUNTIME = "runtime"


class LoraNotFoundError(LookupError):
    """A request or an unload names an adapter that is not served."""


class LoraConflictError(ValueError):
    """A load names an adapter that is served, loading or unloading."""


@dataclass(frozen=True)
class LoraEntry:
    name: str
    path: str  # "" for the adapters the workers loaded at start (--lora-modules)
    source: str  # STARTUP or RUNTIME
    generation: int = 0  # 0 at start; each run-time load a new one

    @property
    def cache_key(self) -> str:
        """The adapter in the prefix-cache hash (start-time adapters: just the name)."""
        return self.name if not self.generation else f"{self.name}\0{self.generation}"


class LoraRegistry:
    def __init__(self, startup: Iterable[str] = ()) -> None:
        self._served = {name: LoraEntry(name, "", STARTUP) for name in startup}
        self._loading: set[str] = set()
        self._unloading: set[str] = set()
        self._generation = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._served))

    @property
    def entries(self) -> list[LoraEntry]:
        return [self._served[name] for name in sorted(self._served)]

    def entry(self, name: str) -> LoraEntry:
        """The served adapter `name` (LoraNotFoundError naming what is served otherwise)."""
        served = self._served.get(name)
        if served is None:
            if name in self._unloading:
                raise LoraNotFoundError(f"lora_name {name!r} is being unloaded")
            loaded = ", ".join(sorted(self._served)) or "none"
            raise LoraNotFoundError(
                f"lora_name {name!r} is not a loaded LoRA adapter; loaded: {loaded}"
            )
        return served

    def cache_key(self, name: str) -> str:
        """What the prefix-cache hash takes for a request's adapter ("" = the base model)."""
        return self.entry(name).cache_key if name else ""

    def begin_load(self, name: str, path: str) -> LoraEntry:
        """Reserve `name` for a run-time load of `path` (LoraConflictError if taken)."""
        if name in self._served:
            raise LoraConflictError(f"LoRA adapter {name!r} is already loaded")
        if name in self._loading:
            raise LoraConflictError(f"LoRA adapter {name!r} is being loaded")
        if name in self._unloading:
            raise LoraConflictError(
                f"LoRA adapter {name!r} is being unloaded (its running requests are finishing)"
            )
        self._generation += 1
        self._loading.add(name)
        return LoraEntry(name, path, RUNTIME, self._generation)

    def finish_load(self, entry: LoraEntry, loaded: bool) -> None:
        """Every worker holds it (served from now on), or the load failed (name freed)."""
        self._loading.discard(entry.name)
        if loaded:
            self._served[entry.name] = entry

    def begin_unload(self, name: str) -> LoraEntry:
        """Stop serving `name` now (its running requests go on); LoraNotFoundError if it
        is not served."""
        entry = self.entry(name)
        del self._served[name]
        self._unloading.add(name)
        return entry

    def finish_unload(self, name: str) -> None:
        """No worker holds it any more: the name is free."""
        self._unloading.discard(name)
