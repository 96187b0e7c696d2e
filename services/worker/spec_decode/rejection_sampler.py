"""Verification of speculative proposals: which of each row's k draft tokens the target
accepts, and the one token it adds (recovered or bonus), so that the emitted tokens are
distributed exactly as the target's own sampling would make them (Leviathan et al. 2023,
Chen et al. 2023).

Inputs are the target's final scores at the k + 1 positions of a row (what the plain sampler
argmaxes or races over: processed logits, divided by the temperature and truncated by
top-k/top-p/min-p to -inf, for the sampled rows; the processed logits for greedy rows) and
each row's noise streams (`seeded_noise.row_streams`), one per output position, so a seeded
row's randomness is a function of its seed and output position only. At output position j
the plain sampler's token is y_j = argmax(scores_j + gumbel(stream_j)) (argmax(scores_j) for
greedy rows). Then:

- `draft_probs` None (n-gram, or a draft model that proposes its argmax): the draft
  distribution q_j is one-hot on the draft x_j. The row accepts x_j iff x_j == y_j and emits
  y_j at the first rejection or after the last draft (bonus). P(accept) = p_j(x_j) = the
  rule's min(1, p/q), and a rejected row emits p_j restricted to tokens != x_j, which is the
  rule's residual max(0, p_j - q_j) normalised: this IS the rejection rule, realised so that
  the emitted tokens equal the plain sampler's, token for token, whatever the drafts were.
  Greedy rows are its temperature-0 case: accept while the draft is the target's argmax.
- `draft_probs` given (a draft model that samples): the draft x_j ~ q_j is accepted iff
  u_j * q_j(x_j) < p_j(x_j), p_j = softmax(scores_j), u_j uniform from column V of the
  position's stream; at the first rejection the row emits argmax(max(0, p_j - q_j) / e_j),
  e_j = exponential(stream_j), the exponential race over the unnormalised residual. The bonus
  token after k accepted drafts is y_k. A draft model that samples must draw with noise
  independent of these streams (e.g. other keys), or acceptance is biased.

Rows are vectorised; the loop runs over the k + 1 positions, each holding [B, V] noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.seeded_noise import exponential, row_streams, uniform

PAD = -1  # output_token_ids after each row's last emitted token


@dataclass(frozen=True)
class RejectionResult:
    output_token_ids: torch.Tensor  # int64 [B, k + 1]: accepted drafts, then one token, then PAD
    num_accepted: torch.Tensor  # int64 [B]: accepted drafts; the row emits num_accepted + 1


def verify_streams(
    keys: torch.Tensor, first_positions: torch.Tensor, num_positions: int
) -> torch.Tensor:
    """Noise streams int64 [B, num_positions, 2] of output positions first, first + 1, ...:
    keys int64 [B, 2] (seed halves, or `random_keys` for unseeded rows) and int64 [B] output
    position of each row's first token this step (the plain sampler's `num_output_tokens`)."""
    rows = keys.shape[0]
    offsets = torch.arange(num_positions, device=keys.device)
    positions = (first_positions.unsqueeze(1) + offsets).reshape(-1)
    streams = row_streams(keys.repeat_interleave(num_positions, dim=0), positions)
    return streams.view(rows, num_positions, 2)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    streams: torch.Tensor | None,
) -> RejectionResult:
    """Verify each row's drafts against the target.

    draft_token_ids int64 [B, k] (padded past `num_draft`, any values there);
    num_draft int64 [B], each in [0, k] (not checked: that would wait for the device);
    target_logits float [B, k + 1, V]: the target's final scores at each position (above);
    draft_probs float [B, k, V] or None (one-hot drafts); greedy bool [B];
    streams int64 [B, k + 1, 2] from `verify_streams`, or None when every row is greedy.
    Positions past a row's num_draft + 1 are ignored, whatever they hold."""
    rows, k = draft_token_ids.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (rows, k + 1):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} for drafts [{rows}, {k}]")
    vocab = target_logits.shape[2]
    if draft_probs is not None and draft_probs.shape != (rows, k, vocab):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)}, expected [{rows}, {k}, {vocab}]")
    if num_draft.shape != (rows,) or greedy.shape != (rows,):
        raise ValueError(f"num_draft {tuple(num_draft.shape)} and greedy must be [{rows}]")
    if streams is not None and streams.shape != (rows, k + 1, 2):
        raise ValueError(f"streams {tuple(streams.shape)}, expected [{rows}, {k + 1}, 2]")
    device = target_logits.device
    vocab_ids = torch.arange(vocab, device=device).unsqueeze(0)
    plain = torch.empty(rows, k + 1, dtype=torch.int64, device=device)  # y_j
    accepted = torch.empty(rows, k, dtype=torch.bool, device=device)
    recovered = plain if draft_probs is None else torch.empty_like(plain)
    for j in range(k + 1):
        scores = target_logits[:, j]
        race = None if streams is None else exponential(streams[:, j], vocab_ids)
        plain[:, j] = _plain_token(scores, greedy, race)
        if j == k:
            break
        drafts = draft_token_ids[:, j]
        accepted[:, j] = drafts == plain[:, j]
        if draft_probs is not None and streams is not None:
            lev_accept, lev_token = _leviathan(
                scores, draft_probs[:, j], drafts, streams[:, j], race
            )
            accepted[:, j] = torch.where(greedy, accepted[:, j], lev_accept)
            recovered[:, j] = torch.where(greedy, plain[:, j], lev_token)
        elif draft_probs is not None:
            recovered[:, j] = plain[:, j]
    if draft_probs is not None:
        recovered[:, k] = plain[:, k]
    has_draft = torch.arange(k, device=device) < num_draft.unsqueeze(1)
    num_accepted = (accepted & has_draft).to(torch.int64).cumprod(dim=1).sum(dim=1)
    index = num_accepted.unsqueeze(1)
    rejected = (num_accepted < num_draft).unsqueeze(1)
    last = torch.where(rejected, recovered.gather(1, index), plain.gather(1, index))
    columns = torch.arange(k + 1, device=device)
    drafts_padded = torch.nn.functional.pad(draft_token_ids.to(torch.int64), (0, 1), value=PAD)
    output = torch.where(columns < index, drafts_padded, last)
    output = output.masked_fill(columns > index, PAD)
    return RejectionResult(output, num_accepted)


def _plain_token(
    scores: torch.Tensor, greedy: torch.Tensor, race: torch.Tensor | None
) -> torch.Tensor:
    """The plain sampler's token: argmax for greedy rows, else argmax(scores + gumbel), the
    gumbel computed exactly as `seeded_noise.gumbel` (so the same bits, the same token)."""
    if race is None:
        return scores.argmax(dim=-1)
    drawn = race.log().neg_().add_(scores).argmax(dim=-1)
    return torch.where(greedy, scores.argmax(dim=-1), drawn)


def _leviathan(
    scores: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    streams: torch.Tensor,
    race: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept bool [B], recovered token int64 [B]) of one position under the rule with a
    sampled draft: accept iff u * q(x) < p(x); else draw from max(0, p - q) by the race."""
    vocab = scores.shape[1]
    p = torch.softmax(scores.float(), dim=-1)
    q = draft_probs.float()
    x = drafts.clamp(0, vocab - 1).unsqueeze(1)
    u = uniform(streams, torch.full((1, 1), vocab, dtype=torch.int64, device=scores.device))
    accept = (u * q.gather(1, x) < p.gather(1, x)).squeeze(1)
    residual = (p - q).clamp_(min=0.0)
    # p == q up to rounding leaves no residual (and a rejection has probability 0): use p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return accept, residual.div_(race).argmax(dim=-1)
