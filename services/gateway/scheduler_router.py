"""Which scheduler gets a request, when the gateway fronts several (pure, no grpc).

In the spirit of SGLang's cache-aware router and Dynamo's KV router: the gateway hashes the
prompt's full blocks (the scheduler's block size, the same chained SHA-256 as the
scheduler's prefix cache, `common/prefix_hash.py`) and remembers, per scheduler, the block
hashes it recently sent there (`PrefixTracker`, a bounded LRU per scheduler). A request
goes to the scheduler whose remembered blocks cover the longest prefix of its prompt,
unless that scheduler is busier than the least-loaded one by more than the balance
thresholds (both must be exceeded, as SGLang's `balance_abs_threshold` and
`balance_rel_threshold`); then, and on ties, the least loaded wins. Equal load as well:
the schedulers take turns. Only the candidates the caller passes (healthy, not draining,
serving the request's adapter) are considered.

The gateway cannot know a scheduler's own deployment salt, so its hashes differ from the
scheduler's; they only have to be consistent among themselves (same tokens, cache salt and
adapter -> same chain), which they are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.prefix_hash import BlockHash, extend_block_hashes, root_hash

# The gateway's own root salt: hashes never leave the gateway.
_GATEWAY_SALT = b"tandem-gateway-router"


@dataclass(frozen=True)
class RouterConfig:
    """The routing knobs. Overlap wins unless the best-overlap scheduler has more than
    `balance_abs_threshold` requests more than the least-loaded one AND more than
    `balance_rel_threshold` times its load; `max_tracked_blocks` bounds each scheduler's
    remembered block hashes (least recently sent dropped first)."""

    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tracked_blocks: int = 32768

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


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str = "", lora_name: str = ""
) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks (a partial last block has none)."""
    root = root_hash(_GATEWAY_SALT, cache_salt, lora_name)
    return extend_block_hashes([], token_ids, block_size, root)


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
        if not known:
            return 0
        count = 0
        for block in hashes:
            if block not in known:
                break
            count += 1
        return count

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


@dataclass(frozen=True)
class Route:
    scheduler: str
    overlap_blocks: int  # remembered prefix blocks on the chosen scheduler
    overridden: bool  # True when load overrode the longest overlap


class SchedulerRouter:
    """Picks a scheduler per request (see the module docstring) and records the choice."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tracker = PrefixTracker(config.max_tracked_blocks)
        self._turn = 0

    def choose(self, hashes: Sequence[BlockHash], loads: Mapping[str, int]) -> Route | None:
        """`loads`: each candidate's requests in flight (only candidates: healthy ones that
        can serve the request); None when there is none. Records the prompt's blocks as
        sent to the chosen scheduler."""
        if not loads:
            return None
        overlaps = {name: self.tracker.overlap(name, hashes) for name in loads}
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
        return Route(chosen, overlaps[chosen], overridden)

    def _imbalanced(self, load: int, least: int) -> bool:
        cfg = self.config
        return load - least > cfg.balance_abs_threshold and load > least * cfg.balance_rel_threshold

    def forget(self, scheduler: str) -> None:
        self.tracker.forget(scheduler)
