"""Turns the scheduler's per-sample token stream into public `GenerateResponse`s.

`SampleOutput` owns one sample: incremental detokenization, stop tokens (whose text is left
out unless `include_stop_str_in_output`), stop strings (armed once `min_tokens` tokens
exist), logprobs with token text, and its finish. `RequestOutput` owns the request: one
SampleOutput per sample, usage (prompt, completion, cached tokens) and timings measured
here, and which message is the stream's last. No grpc: the servicer does the I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.validation import Stopping

TokenText = Callable[[int], str]


def with_token_text(entry: generate_pb2.TokenLogprob, token_text: TokenText):
    """The scheduler's logprob entry (the public message, without token text) with the
    text of its token and of each alternative filled in."""
    out = generate_pb2.TokenLogprob()
    out.CopyFrom(entry)
    out.token = token_text(entry.token_id)
    for top in out.top_logprobs:
        top.token = token_text(top.token_id)
    return out


@dataclass
class SampleTimes:
    first: float | None = None
    last: float | None = None
    count: int = 0

    def record(self, now: float, num_tokens: int) -> None:
        if num_tokens:
            self.first = now if self.first is None else self.first
            self.last = now
            self.count += num_tokens


class SampleOutput:
    def __init__(
        self,
        index: int,
        tokenizer,
        prompt_ids: Sequence[int],
        stopping: Stopping,
        stop_token_ids: frozenset[int],
        token_text: TokenText,
    ) -> None:
        self.index = index
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, stopping.skip_special_tokens)
        self._stops = StopStringMatcher(stopping.stop, stopping.include_stop_str_in_output)
        self._stopping = stopping
        self._stop_token_ids = stop_token_ids
        self._token_text = token_text
        self.num_tokens = 0
        self.cached_tokens = 0
        self.num_draft_tokens = 0  # speculative decoding, from the sample's last message
        self.num_accepted_tokens = 0
        self.finished = False
        self.finish_reason = generate_pb2.FINISH_REASON_UNSPECIFIED  # once finished
        self.times = SampleTimes()

    def consume(self, update: scheduler_pb2.SubmitResponse, now: float):
        """The public message for a scheduler message, or None if there is nothing to say
        (the sample already ended on a stop string)."""
        if self.finished:
            return None
        if update.HasField("usage"):
            self.num_draft_tokens = update.usage.num_draft_tokens
            self.num_accepted_tokens = update.usage.num_accepted_tokens
        if update.cached_tokens:
            self.cached_tokens = update.cached_tokens
        out = generate_pb2.GenerateResponse(index=self.index)
        if update.HasField("beam_score"):
            out.beam_score = update.beam_score
        ended_by_scheduler = update.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
        ids = list(update.token_ids)
        text = []
        for position, token in enumerate(ids):
            self.num_tokens += 1
            out.token_ids.append(token)
            if position < len(update.logprobs):
                out.logprobs.append(with_token_text(update.logprobs[position], self._token_text))
            is_last = position == len(ids) - 1
            if (
                is_last
                and ended_by_scheduler
                and update.finish_reason == generate_pb2.FINISH_REASON_STOP
                and token in self._stop_token_ids
            ):
                out.stop_token_id = token
                if not self._stopping.include_stop_str_in_output:
                    break  # the stop token's own text is left out
            delta = self._detok.add([token])
            if self.num_tokens < self._stopping.min_tokens:
                text.append(delta)  # stop strings are not armed yet
                continue
            safe, match = self._stops.feed(delta)
            text.append(safe)
            if match is not None:
                text[-1] = match.text
                out.stop_string = match.stop
                out.finish_reason = generate_pb2.FINISH_REASON_STOP
                self.finished = True
                break
        if not self.finished and ended_by_scheduler:
            tail = self._detok.flush()
            safe, match = self._stops.feed(tail) if tail else ("", None)
            if match is not None:
                text.append(match.text)
                out.stop_string = match.stop
                out.finish_reason = generate_pb2.FINISH_REASON_STOP
            else:
                text.append(safe + self._stops.flush())
                out.finish_reason = update.finish_reason
            self.finished = True
        out.text = "".join(text)
        if self.finished:
            self.finish_reason = out.finish_reason
        self.times.record(now, len(out.token_ids))
        return out


class RequestOutput:
    """Every sample of one request; knows when the stream is complete."""

    def __init__(
        self,
        request_id: str,
        samples: list[SampleOutput],
        num_prompt_tokens: int,
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.samples = samples
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival
        self._prompt_logprobs_sent = False

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    def consume(
        self, update: scheduler_pb2.SubmitResponse, token_text: TokenText, now: float | None = None
    ) -> generate_pb2.GenerateResponse | None:
        now = time.monotonic() if now is None else now
        out = self.samples[update.index].consume(update, now)
        if out is None:
            return None
        out.request_id = self.request_id
        if update.prompt_logprobs and not self._prompt_logprobs_sent:
            self._prompt_logprobs_sent = True
            out.prompt_logprobs.extend(
                with_token_text(e, token_text) for e in update.prompt_logprobs
            )
        if self.done:
            out.usage.CopyFrom(self.usage())
            out.timings.CopyFrom(self.timings(now))
        return out

    def usage(self) -> generate_pb2.Usage:
        return generate_pb2.Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=sum(s.num_tokens for s in self.samples),
            cached_tokens=self.samples[0].cached_tokens,
            num_draft_tokens=sum(s.num_draft_tokens for s in self.samples),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in self.samples),
        )

    def timings(self, now: float) -> generate_pb2.Timings:
        firsts = [s.times.first for s in self.samples if s.times.first is not None]
        itls = [
            (s.times.last - s.times.first) / (s.times.count - 1)
            for s in self.samples
            if s.times.count > 1
        ]
        return generate_pb2.Timings(
            ttft_ms=(min(firsts) - self.arrival) * 1e3 if firsts else 0.0,
            mean_itl_ms=sum(itls) / len(itls) * 1e3 if itls else 0.0,
            e2e_ms=(now - self.arrival) * 1e3,
        )
