"""N-gram (prompt lookup) proposals: guess a request's next tokens by finding its latest
tokens earlier in its own prompt and output, and proposing what followed them there.

`propose_ngram` looks for the longest suffix n-gram (n from `max_n` down to `min_n`) of the
sequence that also occurs earlier in it. Among the earlier occurrences of that n-gram it
takes the EARLIEST (as vLLM does): in a loop of period p the earliest occurrence still has
k tokens after it where the most recent has only p, and the first time a passage was seen
is where it continues. The proposal is the (up to) k tokens that followed the occurrence,
fewer when the sequence ends first; [] when no n-gram of at least `min_n` tokens recurs.

The search is vectorised numpy with no loop over positions: one comparison of the whole
sequence against its last token gives the candidate occurrence ends, then each further pass
(at most `max_n` - 1) keeps the candidates whose next-earlier token also matches: as a mask
over the sequence while many survive, then over the survivors' indices. Measured per 32k-token
lookup from an int64 array on the 2-core build machine (numpy 2.4, min_n 1, k 4): about
30 us for text-like tokens (vocabulary 32k, max_n 4 or 32), 50 us over a vocabulary of 50,
60 us (max_n 4) to 0.3 ms (max_n 32) for a 37-token loop repeated, and at worst (one token
repeated 32k times, every position a candidate at every n) 0.1 ms (max_n 4) to 0.55 ms
(max_n 32). A Python list costs about 1 ms more to convert, so keep hot histories as arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Candidate ends stay a mask over all positions while more than 1 in _DENSE survive (faster
# than indices there), then become an index array.
_DENSE = 32


def _check(min_n: int, max_n: int, k: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
    if k < 1:
        raise ValueError(f"k (tokens to propose) must be >= 1, got {k}")


def _as_array(token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(token_ids, np.ndarray) and token_ids.dtype.kind in "iu":
        return token_ids.reshape(-1)
    return np.asarray(token_ids, dtype=np.int64).reshape(-1)


def match_ngram(token_ids: np.ndarray | Sequence[int], min_n: int, max_n: int) -> tuple[int, int]:
    """(n, end) of the longest suffix n-gram, n in [min_n, max_n], that occurs earlier in the
    sequence, `end` being the index of the last token of its earliest earlier occurrence;
    (0, -1) when there is none."""
    _check(min_n, max_n, 1)
    tokens = _as_array(token_ids)
    last = len(tokens) - 1
    if last < min_n:
        return 0, -1
    # Candidate ends e of earlier occurrences (e < last, so a token follows each) whose match
    # with the suffix, read backwards from e and from `last`, is `length` tokens so far. Each
    # pass extends the match by one token: over a mask of all ends while many candidates
    # survive, then over the survivors' indices.
    alive = tokens[:last] == tokens[last]
    count = int(np.count_nonzero(alive))
    ends: np.ndarray | None = None
    length, best_length, best_end = 1, 0, -1
    while count:
        if length >= min_n:  # the first survivor is the earliest occurrence
            best_length = length
            best_end = int(ends[0]) if ends is not None else int(np.argmax(alive))
        if length == max_n:
            break
        if ends is None and count * _DENSE > last:
            alive[:length] = False  # no token before them to extend the match with
            alive[length:] &= tokens[: last - length] == tokens[last - length]
            count = int(np.count_nonzero(alive))
        else:
            ends = np.flatnonzero(alive) if ends is None else ends
            ends = ends[ends >= length]
            ends = ends[tokens[ends - length] == tokens[last - length]]
            count = ends.size
        length += 1
    return best_length, best_end


def propose_ngram(
    token_ids: np.ndarray | Sequence[int], min_n: int, max_n: int, k: int
) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the sequence's
    longest recurring suffix n-gram (min_n <= n <= max_n); [] when none recurs."""
    _check(min_n, max_n, k)
    tokens = _as_array(token_ids)
    n, end = match_ngram(tokens, min_n, max_n)
    if n == 0:
        return []
    return tokens[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    """The worker's n-gram proposer (`spec_decode.verify.Proposer`), with the speculative
    config's lookup window."""

    def __init__(self, min_n: int, max_n: int) -> None:
        _check(min_n, max_n, 1)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_tokens: int) -> list[int]:
        """A request's prompt + output so far -> up to `max_tokens` proposed tokens."""
        if max_tokens < 1:
            return []
        return propose_ngram(token_ids, self.min_n, self.max_n, max_tokens)
