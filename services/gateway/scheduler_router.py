"""Which scheduler gets a request, when the gateway fronts several (pure, no grpc).

In the spirit of SGLang's cache-aware router and Dynamo's KV router: the gateway hashes the
prompt's full blocks (the scheduler's block size, the same chained SHA-256 as the
scheduler's prefix cache, `common/prefix_hash.py`) and asks, per scheduler, how many of its
leading blocks that scheduler holds:

- from the scheduler's KV events while its stream is followed (`kv_index.py`: what its
  prompt pools really cache, in every medium), together with the prompts of the requests
  this gateway has open there (`InFlightPrefixes`: blocks it is computing, before its
  events can tell);
- otherwise (no stream yet, a gap, a scheduler without events) from the block hashes
  recently sent there (`PrefixTracker`, a bounded LRU per scheduler): the fallback.

A request goes to the scheduler holding the longest prefix of its prompt, unless that
scheduler is busier than the least-loaded one by more than the balance thresholds (both
must be exceeded, as SGLang's `balance_abs_threshold` and `balance_rel_threshold`); then,
and on ties, the least loaded wins. Equal load as well: the schedulers take turns. Only the
candidates the caller passes (healthy, not draining, serving the request's adapter) are
considered.

The gateway cannot know a scheduler's own deployment salt, so its hashes differ from the
scheduler's; they only have to be consistent among themselves (same tokens, cache salt and
adapter -> same chain), which they are, and the events are rebuilt into the same chain.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from common.prefix_hash import BlockHash, extend_block_hashes, root_hash
from services.gateway.kv_index import SchedulerKvIndex

# The gateway's own root salt: hashes never leave the gateway.
_GATEWAY_SALT = b"tandem-gateway-router"


@dataclass(frozen=True)
class RouterConfig:
    """The routing knobs. Overlap wins unless the best-overlap scheduler has more than
    `balance_abs_threshold` requests more than the least-loaded one AND more than
    `balance_rel_threshold` times its load; `max_tracked_blocks` bounds each scheduler's
    remembered block hashes (least recently sent dropped first); `kv_events`: follow the
    schedulers' KV events (off: only the memory of what was sent), subscribing again
    `kv_events_retry_s` after a stream breaks."""

    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tracked_blocks: int = 32768
    kv_events: bool = True
    kv_events_retry_s: float = 1.0

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}"
            )
        if not self.balance_rel_threshold >= 1.0:  # NaN fails too
            raise ValueError(
                f"balance_rel_threshold must be >= 1.0, got {self.balance_rel_threshold}"
            )
        if self.max_tracked_blocks < 1:
            raise ValueError(f"max_tracked_blocks must be >= 1, got {self.max_tracked_blocks}")
        if not self.kv_events_retry_s > 0:
            raise ValueError(f"kv_events_retry_s must be > 0, got {self.kv_events_retry_s}")


def gateway_root(cache_salt: str = "", lora_name: str = "", rope_key: str = "") -> BlockHash:
    """The root of the gateway's chains (its own salt; the rest as the scheduler's)."""
    return root_hash(_GATEWAY_SALT, cache_salt, lora_name, rope_key)


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str = "", lora_name: str = ""
) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks (a partial last block has none). The
    gateway does not know the model's RoPE scaling: a prompt long enough for a
    length-dependent RoPE to change its KV (a root with a RoPE key, in the events) simply
    finds no overlap."""
    return extend_block_hashes([], token_ids, block_size, gateway_root(cache_salt, lora_name))


def leading(hashes: Sequence[BlockHash], held: Callable[[BlockHash], bool]) -> int:
    """Leading blocks of `hashes` that `held` says are there (a chain: the first miss ends
    the shared prefix)."""
    count = 0
    for block in hashes:
        if not held(block):
            break
        count += 1
    return count


class PrefixTracker:
    """Per scheduler, the block hashes recently routed to it, as a bounded LRU."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[BlockHash, None]] = {}

    def overlap(self, scheduler: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` remembered for `scheduler` (a chain: the first miss
        ends the shared prefix)."""
        known = self._blocks.get(scheduler)
        return leading(hashes, known.__contains__) if known else 0

    def record(self, scheduler: str, hashes: Sequence[BlockHash]) -> None:
        """`scheduler` received these blocks now: most recent, oldest beyond the bound go."""
        known = self._blocks.setdefault(scheduler, OrderedDict())
        for block in hashes:
            known[block] = None
            known.move_to_end(block)
        while len(known) > self.max_blocks:
            known.popitem(last=False)

    def forget(self, scheduler: str) -> None:
        """The scheduler's cache is gone or unknown (it restarted, its stream broke)."""
        self._blocks.pop(scheduler, None)

    def size(self, scheduler: str) -> int:
        return len(self._blocks.get(scheduler, ()))


class InFlightPrefixes:
    """Per scheduler, the prompt blocks of the requests this gateway has open there."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[str, tuple[BlockHash, ...]]] = {}
        self._blocks: dict[str, Counter[BlockHash]] = {}

    def add(self, request_id: str, scheduler: str, hashes: Sequence[BlockHash]) -> None:
        """The request now runs on `scheduler` (wherever it was before: no more)."""
        self.remove(request_id)
        self._requests[request_id] = (scheduler, tuple(hashes))
        self._blocks.setdefault(scheduler, Counter()).update(hashes)

    def remove(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        scheduler, hashes = entry
        blocks = self._blocks[scheduler]
        blocks.subtract(hashes)
        for block in hashes:
            if blocks[block] <= 0:
                del blocks[block]

    def overlap(self, scheduler: str, hashes: Sequence[BlockHash]) -> int:
        blocks = self._blocks.get(scheduler)
        return leading(hashes, blocks.__contains__) if blocks else 0

    def __len__(self) -> int:
        return len(self._requests)


@dataclass(frozen=True)
class Route:
    scheduler: str
    overlap_blocks: int  # prefix blocks the chosen scheduler holds (as the router knows)
    overridden: bool  # True when load overrode the longest overlap
    from_events: bool  # the chosen scheduler's overlap came from its KV events


class SchedulerRouter:
    """Picks a scheduler per request (see the module docstring) and records the choice."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tracker = PrefixTracker(config.max_tracked_blocks)
        self.in_flight = InFlightPrefixes()
        self.indexes: dict[str, SchedulerKvIndex] = {}  # schedulers whose events it follows
        self._turn = 0

    def overlap(self, scheduler: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` that `scheduler` holds, as far as the router knows."""
        index = self.indexes.get(scheduler)
        if index is None:
            return self.tracker.overlap(scheduler, hashes)
        return max(index.overlap(hashes), self.in_flight.overlap(scheduler, hashes))

    def choose(
        self, hashes: Sequence[BlockHash], loads: Mapping[str, int], request_id: str = ""
    ) -> Route | None:
        """`loads`: each candidate's requests in flight (only candidates: healthy ones that
        can serve the request); None when there is none. Records the prompt's blocks as
        sent to the chosen scheduler (and, with a `request_id`, as in flight there until
        `finished`)."""
        if not loads:
            return None
        overlaps = {name: self.overlap(name, hashes) for name in loads}
        least = min(loads.values())
        top = max(overlaps.values())
        best_load = min(loads[n] for n in loads if overlaps[n] == top)
        overridden = top > 0 and self._imbalanced(best_load, least)
        if overridden:  # the least loaded, by overlap among them
            load = least
            top = max(overlaps[n] for n in loads if loads[n] == least)
        else:  # the longest overlap, least loaded among them
            load = best_load
        tied = [n for n in loads if overlaps[n] == top and loads[n] == load]
        chosen = tied[self._turn % len(tied)]
        if len(tied) > 1:
            self._turn += 1
        self.tracker.record(chosen, hashes)
        if request_id:
            self.in_flight.add(request_id, chosen, hashes)
        return Route(chosen, overlaps[chosen], overridden, chosen in self.indexes)

    def finished(self, request_id: str) -> None:
        """The request is over (or failed over elsewhere: `choose` moves it)."""
        self.in_flight.remove(request_id)

    def follow(self, scheduler: str, index: SchedulerKvIndex) -> None:
        """Route by this index of the scheduler's KV events from now on."""
        self.indexes[scheduler] = index

    def unfollow(self, scheduler: str) -> None:
        """Its events can no longer be trusted: back to the memory of what was sent."""
        self.indexes.pop(scheduler, None)

    def _imbalanced(self, load: int, least: int) -> bool:
        cfg = self.config
        return load - least > cfg.balance_abs_threshold and load > least * cfg.balance_rel_threshold

    def forget(self, scheduler: str) -> None:
        """The scheduler went unhealthy: what was sent there is gone or unknown (its events,
        if followed, go on saying what it holds: a dead one's stream breaks)."""
        self.tracker.forget(scheduler)
