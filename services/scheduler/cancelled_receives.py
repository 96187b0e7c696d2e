"""KV receives into a pool that were given up (a cancelled request, a failed transfer),
until the worker hears of them.

The worker learns a cancelled receive's tag with the next step planned for it; until that
step is planned the request's blocks stay allocated under a key of their own, so a
receive still under way on the worker cannot write into blocks already handed to another
request's receive. Pure Python.
"""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager


class CancelledReceives:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._tags: list[int] = []
        self._held: list[str] = []

    def cancel(self, tag: int, request_id: str) -> None:
        """Give up receive `tag` into `request_id`'s blocks (held until `take`)."""
        if self.blocks.has(request_id):
            key = f"\0cancelled-transfer-{tag:x}"
            self.blocks.fork(request_id, key)
            self.blocks.free(request_id)
            self._held.append(key)
        self._tags.append(tag)

    @property
    def pending(self) -> bool:
        """Tags the next plan must carry."""
        return bool(self._tags)

    def take(self) -> list[int]:
        """The tags not yet sent (the next plan carries them); the blocks held for them are
        free now. Also called when the worker is gone: a new step stream, which drops
        every receive, comes before any reuse."""
        for key in self._held:
            self.blocks.free(key)
        tags, self._held, self._tags = self._tags, [], []
        return tags
