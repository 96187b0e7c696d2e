"""Beam search policy for one request: which beams live, fork and finish after each step.

Owns the choice of continuations, the finished hypotheses and the stopping rule, and
reproduces Hugging Face transformers' `generate(num_beams=k, do_sample=False)` (5.x,
`GenerationMixin._beam_search`) token for token. The caller owns the model and the KV: each
step it supplies, per live beam, the top `candidates_needed()` tokens with their logprobs
(log_softmax of the fp32 logits, after any logits processors) and applies the returned forks
(a new beam shares its parent's KV; the first child of a parent keeps the parent's id).

HF rules mirrored (names of its helpers in brackets):
- K = max(2, 1 + len(eos)) * beam_width candidates are taken over all beams x vocab by
  accumulated logprob [`_get_top_k_continuations`]; the global top K never holds more than K
  tokens of one beam, so K per beam suffices. On the first step only beam 0 exists; HF's other
  rows are copies of it scored -1e9 and are emulated here (they matter when vocab < K).
- A candidate hitting a stop (an EOS token, or the max_new_tokens-th token) becomes a finished
  hypothesis only if ranked among the first beam_width candidates; it never continues. The
  next live beams are the best beam_width candidates after stopped ones are pushed down by
  1e9 [`_get_running_beams_for_next_iteration`].
- A hypothesis scores sum_logprobs / generated_len ** length_penalty, generated_len counting
  the generated tokens including the EOS, not the prompt. HF keeps beam_width finished
  "slots" (unfilled or losing ones hold scores around -1e9) and merges new ones in by score
  [`_update_finished_beams`]. At max_new_tokens every candidate stops, so the best
  beam_width candidates of that last step are merged in: HF's finalisation.
- After a step the search is done when every candidate stopped, or all slots are finished
  and early_stopping is True, or the best live score / L ** length_penalty is not above the
  worst slot (-1e9 while a slot is unfilled), with L = max_new_tokens for "never" with a
  positive length_penalty and the generated length otherwise
  [`_check_early_stop_heuristic`, `_beam_search_has_unfinished_sequences`].
Scores are rounded to float32 after every add and divide, as HF's fp32 tensors are, so the
ranking matches bit for bit given fp32 logprobs. Equal scores rank by beam row then token id
(the flattened index, first wins) and merges are stable (old slots before new candidates);
torch.topk does not promise an order for ties. HF runs greedy search for num_beams=1; here
beam_width=1 is a one-beam search (the same tokens unless length_penalty favours length).
Pure Python.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

MASKED = -1.0e9  # HF's score for absent rows, unfilled slots and pushed-down candidates
_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """x rounded to float32 (double then float rounding is exact for + and /)."""
    return _F32.unpack(_F32.pack(x))[0]


@dataclass(frozen=True, kw_only=True)
class BeamParams:
    beam_width: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    eos_token_ids: tuple[int, ...] = ()
    max_new_tokens: int
    num_return_sequences: int = 1
    prompt_len: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1: {self.beam_width!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1: {self.max_new_tokens!r}")
        if not _is_int(self.prompt_len) or self.prompt_len < 1:
            raise ValueError(f"prompt_len must be an int >= 1: {self.prompt_len!r}")
        r = self.num_return_sequences
        if not _is_int(r) or not 1 <= r <= self.beam_width:
            raise ValueError(
                f"num_return_sequences must be an int in [1, beam_width={self.beam_width}]: {r!r}"
            )
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never': {self.early_stopping!r}"
            )
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number: {lp!r}")
        if not all(_is_int(t) and t >= 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be ints >= 0: {self.eos_token_ids!r}")
        if len(set(self.eos_token_ids)) != len(self.eos_token_ids):
            raise ValueError(f"eos_token_ids has duplicates: {self.eos_token_ids!r}")

    @property
    def max_length(self) -> int:
        """HF's max_length: prompt plus new tokens."""
        return self.prompt_len + self.max_new_tokens


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Beam:
    beam_id: int
    tokens: tuple[int, ...]  # generated so far
    score: float  # fp32 sum of logprobs


class Fork(NamedTuple):
    """One new live beam: `parent` (index `parent_index` in the previous live list) plus
    `token`. `beam_id == parent_id` when it continues its parent's KV in place."""

    beam_id: int
    parent_id: int
    parent_index: int
    token: int


class Hypothesis(NamedTuple):
    tokens: tuple[int, ...]  # generated tokens, with the EOS when one ended it
    score: float  # sum_logprobs / len(tokens) ** length_penalty


@dataclass(frozen=True)
class StepResult:
    forks: tuple[Fork, ...]  # the new live beams, in order (empty once done)
    freed: tuple[int, ...]  # previous beam ids no new beam references
    finished: int  # hypotheses that entered the finished slots this step
    done: bool


@dataclass(frozen=True)
class _Slot:
    score: float
    tokens: tuple[int, ...]
    finished: bool = False


class _Cand(NamedTuple):
    score: float
    row: int
    token: int
    parent_index: int


class BeamSearch:
    """One request's beam search state; see the module docstring for the rules."""

    def __init__(self, params: BeamParams) -> None:
        self.params = params
        self._k = max(2, 1 + len(params.eos_token_ids)) * params.beam_width
        self._eos = frozenset(params.eos_token_ids)
        self._live: list[Beam] = [Beam(0, (), 0.0)]
        self._next_id = 1
        self._steps = 0
        self._slots = [_Slot(MASKED, ())] * params.beam_width  # best first
        self._done = False

    def candidates_needed(self) -> int:
        """Top tokens to supply per live beam (fewer only when the vocabulary is smaller)."""
        return self._k

    @property
    def live_beams(self) -> tuple[Beam, ...]:
        return tuple(self._live)

    @property
    def num_steps(self) -> int:
        return self._steps

    def is_done(self) -> bool:
        return self._done

    def step(self, per_beam: Sequence[Sequence[tuple[int, float]]]) -> StepResult:
        """Advance one token. `per_beam[i]`: (token_id, logprob) pairs of live beam i, at least
        min(candidates_needed(), vocab) of its best, in any order, without duplicates."""
        if self._done:
            raise RuntimeError("beam search is done")
        if len(per_beam) != len(self._live):
            raise ValueError(f"expected candidates for {len(self._live)} beams: {len(per_beam)}")
        p = self.params
        width = p.beam_width
        cands: list[_Cand] = []
        for i, (beam, tops) in enumerate(zip(self._live, per_beam, strict=True)):
            cands.extend(_Cand(_f32(beam.score + lp), i, t, i) for t, lp in _checked(tops))
        if self._steps == 0:  # HF's rows 1.. repeat the prompt, scored -1e9
            for row in range(1, width):
                cands.extend(_Cand(_f32(MASKED + lp), row, t, 0) for t, lp in per_beam[0])
        if len(cands) < self._k:
            raise ValueError(f"need {self._k} candidates over all beams, got {len(cands)}")
        cands.sort(key=lambda c: (-c.score, c.row, c.token))
        top = cands[: self._k]

        gen_len = self._steps + 1
        last = gen_len >= p.max_new_tokens
        hits = [last or c.token in self._eos for c in top]
        tokens = [self._live[c.parent_index].tokens + (c.token,) for c in top]

        # Finished slots: merge the candidates in (only the first `width` ranks that stopped
        # count as finished), keep the best `width`.
        denom = _f32(gen_len**p.length_penalty)
        merged: list[tuple[_Slot, bool]] = [(s, False) for s in self._slots]
        for rank, (c, hit, toks) in enumerate(zip(top, hits, tokens, strict=True)):
            score = _f32(c.score / denom)
            finished = hit and rank < width
            if not finished:
                score = _f32(score + MASKED)
            merged.append((_Slot(score, toks, finished), True))
        merged.sort(key=lambda m: -m[0].score)  # stable: old slots win ties
        kept = merged[:width]
        self._slots = [s for s, _ in kept]
        new_finished = sum(1 for s, new in kept if new and s.finished)

        # Next live beams: the best `width` after stopped candidates are pushed down.
        running = [
            _f32(c.score + MASKED) if hit else c.score for c, hit in zip(top, hits, strict=True)
        ]
        chosen = sorted(range(len(top)), key=lambda r: -running[r])[:width]
        self._steps = gen_len

        all_finished = all(s.finished for s in self._slots)
        done = (
            all(hits)
            or (all_finished and p.early_stopping is True)
            or not self._improvement_possible(running[chosen[0]])
        )
        old = self._live
        if done:
            self._done = True
            self._live = []
            return StepResult((), tuple(b.beam_id for b in old), new_finished, True)

        forks: list[Fork] = []
        new_live: list[Beam] = []
        kept_ids: set[int] = set()
        for r in chosen:
            c = top[r]
            parent = old[c.parent_index]
            if parent.beam_id in kept_ids:
                beam_id = self._next_id
                self._next_id += 1
            else:
                beam_id = parent.beam_id
                kept_ids.add(beam_id)
            forks.append(Fork(beam_id, parent.beam_id, c.parent_index, c.token))
            new_live.append(Beam(beam_id, tokens[r], running[r]))
        self._live = new_live
        freed = tuple(b.beam_id for b in old if b.beam_id not in kept_ids)
        return StepResult(tuple(forks), freed, new_finished, False)

    def _improvement_possible(self, best_running: float) -> bool:
        """HF's early-stop heuristic: can the best live beam still beat a finished slot?"""
        p = self.params
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            length = p.max_new_tokens
        else:
            length = self._steps
        best = _f32(best_running / _f32(length**p.length_penalty))
        worst = self._slots[-1].score  # min over all slots, unfilled ones included
        return any(best > (worst if s.finished else MASKED) for s in self._slots)

    def results(self) -> list[Hypothesis]:
        """The best num_return_sequences hypotheses, best first (HF's order). Only when HF
        would too (a vocabulary too small to fill the slots) can one be an unfinished
        candidate scored around -1e9."""
        if not self._done:
            raise RuntimeError("beam search is not done")
        best = self._slots[: self.params.num_return_sequences]
        return [Hypothesis(s.tokens, s.score) for s in best]


def _checked(tops: Sequence[tuple[int, float]]) -> Sequence[tuple[int, float]]:
    seen: set[int] = set()
    for token, logprob in tops:
        if not _is_int(token) or token < 0 or token in seen:
            raise ValueError(f"bad or duplicate candidate token id: {token!r}")
        if math.isnan(logprob):
            raise ValueError(f"logprob of token {token} is NaN")
        seen.add(token)
    return tops
