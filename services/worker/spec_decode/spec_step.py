"""One step's speculative decoding, around the runner's forward pass: which requests get
proposals (`propose`), the one-token rows that verify them (`rows`), which rows are sampled
with which history (`sample_rows`), and what the samples make of them (`outcomes`). Keeps
the runner free of speculative bookkeeping. Pure Python (the runner does the tensors)."""

from __future__ import annotations

from collections.abc import Sequence

from common.sampling import Logprob
from common.step_result import SpecOutcome
from services.worker.batch import ScheduledWork
from services.worker.models.attention_metadata import SequenceSlice
from services.worker.sampler import SamplingRow
from services.worker.spec_decode.verify import BatchProposer, Proposer, verify


class SpecStep:
    def __init__(
        self, work: Sequence[ScheduledWork], proposer: Proposer | BatchProposer | None
    ) -> None:
        """Proposals for the requests with lookahead slots that sample this step."""
        self.work = work
        self.drafts: dict[int, list[int]] = {}  # work index -> its proposals (none empty)
        self._first_slice: dict[int, int] = {}
        # A draft model's cost, for the scheduler's slot policy (spec_goodput.py).
        self.propose_seconds = 0.0
        self.propose_passes = 0
        if proposer is None:
            return
        # A grammar-constrained request gets none: its drafts would be verified unmasked.
        wanted = [
            i
            for i, item in enumerate(work)
            if item.num_lookahead_tokens and item.samples and item.request.structured is None
        ]
        if not wanted:
            return
        if hasattr(proposer, "propose_batch"):  # a draft model: one pass per proposal
            asked = [(work[i].request, work[i].num_lookahead_tokens) for i in wanted]
            proposals = proposer.propose_batch(asked)
            self.propose_seconds, self.propose_passes = proposer.priced
        else:
            proposals = [
                proposer.propose(work[i].request.token_ids, work[i].num_lookahead_tokens)
                for i in wanted
            ]
        for i, proposal in zip(wanted, proposals, strict=True):
            if len(proposal):
                self.drafts[i] = list(proposal[: work[i].num_lookahead_tokens])

    def rows(self, input_ids: list[int], slices: list[SequenceSlice]) -> None:
        """Append each proposal as a one-token row at the next position, with its request's
        block table, after every request's own rows (work index i stays slice i)."""
        for i, proposal in self.drafts.items():
            request = self.work[i].request
            end = len(request.token_ids)
            self._first_slice[i] = len(slices)
            input_ids.extend(proposal)
            slices.extend(
                SequenceSlice(end + j, 1, request.block_ids) for j in range(len(proposal))
            )

    def sample_rows(self, query_start_loc: Sequence[int]) -> tuple[list[int], list[SamplingRow]]:
        """Flat rows to sample after the plain ones, and how: proposal j's row samples the
        token after it, with the proposals up to it taken as accepted."""
        flat: list[int] = []
        rows: list[SamplingRow] = []
        for i, proposal in self.drafts.items():  # (none: a plain step, nothing to do)
            request, first = self.work[i].request, self._first_slice[i]
            for j in range(len(proposal)):
                flat.append(query_start_loc[first + j])
                history = [*request.token_ids, *proposal[: j + 1]]
                rows.append(SamplingRow(request.sampling, history, request.num_prompt_tokens))
        return flat, rows

    def outcomes(
        self,
        samplers: Sequence[int],
        tokens: Sequence[int],
        entries: Sequence[Logprob | None],
        sampled: dict[str, int],
        logprobs: dict[str, Logprob],
    ) -> dict[str, SpecOutcome]:
        """Verify every proposal against its row's sample (`tokens`/`entries`: the plain
        rows of `samplers`, then `sample_rows`' in order); each request's last token and its
        logprob go into `sampled`/`logprobs` in place of the plain row's."""
        out: dict[str, SpecOutcome] = {}
        if not self.drafts:
            return out
        at, row_of = len(samplers), {i: k for k, i in enumerate(samplers)}
        for i, proposal in self.drafts.items():
            rid, k = self.work[i].request.request_id, row_of[i]
            row_ids = [k, *range(at, at + len(proposal))]
            at += len(proposal)
            verified = verify(proposal, [tokens[r] for r in row_ids])
            n = len(verified.accepted)
            sampled[rid] = verified.token
            if entries[k] is not None:
                logprobs[rid] = entries[row_ids[n]]
            out[rid] = SpecOutcome(
                verified.accepted, len(proposal), [entries[r] for r in row_ids[:n]]
            )
        return out
