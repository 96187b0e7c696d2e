"""Per-request grammar matchers and the batched token mask.

Each constrained request has one `xgrammar.GrammarMatcher`; a request that arrives with
tokens already generated (a decode worker taking it over, a recompute after preemption or
a worker failure) replays them, so the matcher's state follows the request wherever it
runs. Per step, `mask` fills one bitmask row per constrained logits row and applies them
all in one call; `accept` advances a request's matcher by the token sampled for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RequestMatchers:
    def __init__(self, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._matchers: dict[str, object] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def start(self, request_id: str, compiled, generated: Sequence[int] = ()) -> None:
        """A matcher for `request_id`, advanced over the tokens it already generated
        (ValueError if one of them breaks the grammar)."""
        matcher = self._xgr.GrammarMatcher(compiled)
        for token in generated:
            if not matcher.accept_token(int(token)):
                raise ValueError(f"request {request_id}: token {token} does not fit its grammar")
        self._matchers[request_id] = matcher

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def terminated(self, request_id: str) -> bool:
        """The grammar accepted its stop token: the output is complete and ended."""
        return self._matchers[request_id].is_terminated()

    def completed(self, request_id: str) -> bool:
        """The output so far is complete (a stop token is allowed next)."""
        return self._matchers[request_id].is_completed()

    def mask(self, logits: torch.Tensor, rows: Sequence[tuple[int, str]]) -> None:
        """Set to -inf, in place, every token the grammar of each (logits row, request)
        does not allow next; rows of other requests are untouched."""
        if not rows:
            return
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (_, request_id) in enumerate(rows):
            self._matchers[request_id].fill_next_token_bitmask(bitmask, i)
        index = torch.tensor([row for row, _ in rows], dtype=torch.long, device=logits.device)
        picked = logits.index_select(0, index)
        xgr.apply_token_bitmask_inplace(picked, bitmask.to(logits.device))
        logits.index_copy_(0, index, picked)

    def accept(self, request_id: str, token: int) -> bool:
        """Advance by the sampled token; False if the grammar refuses it."""
        return self._matchers[request_id].accept_token(int(token))
