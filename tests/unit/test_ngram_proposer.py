"""Prompt-lookup proposals: the longest recurring suffix n-gram wins, its earliest earlier
occurrence is the one continued, proposals stop at k or at the end of the sequence, and the
vectorised search equals a plain Python reference on many random sequences."""

import numpy as np
import pytest

from services.worker.spec_decode.ngram_proposer import NgramProposer, match_ngram, propose_ngram


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, position by position: longest n first, earliest start first."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= size:
            continue
        suffix = tokens[size - n :]
        for start in range(size - n):  # earlier starts only: a token always follows
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_basic_match():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2], 1, 3, 2) == [3, 4]
    assert propose_ngram([7, 8, 9, 7], 1, 1, 3) == [8, 9, 7]


def test_longest_n_is_preferred():
    # Suffix [5, 6]: the 1-gram [6] first recurs at index 1 (followed by 0, 0); the 2-gram
    # [5, 6] recurs at indices 3..4 (followed by 9).
    tokens = [0, 6, 0, 0, 5, 6, 9, 5, 6]
    assert match_ngram(tokens, 1, 2) == (2, 5)
    assert propose_ngram(tokens, 1, 2, 2) == [9, 5]
    assert propose_ngram(tokens, 1, 1, 2) == [0, 0]  # max_n caps the match


def test_earliest_occurrence_is_continued():
    # [1, 2] occurs at 0 (followed by 10) and at 4 (followed by 20): the earliest wins.
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert match_ngram(tokens, 2, 2) == (2, 1)
    assert propose_ngram(tokens, 2, 2, 2) == [10, 11]


def test_a_loop_proposes_full_k_from_its_first_period():
    loop = [3, 1, 4] * 5
    assert propose_ngram(loop, 1, 3, 5) == [3, 1, 4, 3, 1]


def test_proposal_truncated_at_k_and_at_the_end_of_the_sequence():
    tokens = [4, 5, 6, 7, 8, 9, 4, 5]
    assert propose_ngram(tokens, 2, 2, 3) == [6, 7, 8]
    assert propose_ngram(tokens, 2, 2, 100) == [6, 7, 8, 9, 4, 5]
    # Overlapping occurrence: [2, 2] at 0..1 is followed only by the sequence's own tail.
    assert propose_ngram([2, 2, 2], 2, 2, 4) == [2]


def test_no_match():
    assert propose_ngram([1, 2, 3, 4], 1, 4, 3) == []
    assert propose_ngram([1, 2, 1, 3], 1, 4, 3) == []  # suffix [3] never recurs
    assert propose_ngram([1, 2, 9, 1, 2], 3, 3, 3) == []  # only the 2-gram recurs
    assert match_ngram([1, 2, 3], 1, 2) == (0, -1)


def test_min_n_longer_than_the_sequence():
    assert propose_ngram([], 1, 2, 3) == []
    assert propose_ngram([5], 1, 2, 3) == []
    assert propose_ngram([5, 5], 2, 3, 3) == []
    assert propose_ngram([5, 5, 5], 2, 3, 3) == [5]


def test_array_inputs_and_dtypes():
    tokens = [9, 8, 7, 9, 8]
    for array in (np.array(tokens), np.array(tokens, dtype=np.int32), tuple(tokens)):
        assert propose_ngram(array, 1, 2, 2) == [7, 9]


def test_invalid_arguments():
    for min_n, max_n, k in ((0, 2, 1), (3, 2, 1), (1, 2, 0)):
        with pytest.raises(ValueError):
            propose_ngram([1, 2], min_n, max_n, k)
        if k:
            with pytest.raises(ValueError):
                NgramProposer(min_n, max_n)


@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_matches_the_reference_on_random_sequences(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(400):
        size = int(rng.integers(0, 60))
        tokens = rng.integers(0, vocab, size).tolist()
        min_n = int(rng.integers(1, 5))
        args = (tokens, min_n, int(rng.integers(min_n, 8)), int(rng.integers(1, 6)))
        assert propose_ngram(*args) == reference(*args), args


def test_dense_and_sparse_candidate_paths_match_the_reference():
    """Long sequences take the mask pass (many candidates) and then the index pass."""
    rng = np.random.default_rng(7)
    for vocab, size in ((2, 3000), (4, 2000), (40, 2000)):
        for _ in range(5):
            tokens = rng.integers(0, vocab, size).tolist()
            assert propose_ngram(tokens, 1, 12, 4) == reference(tokens, 1, 12, 4)
    tokens = [0] * 500  # every position a candidate at every n
    assert propose_ngram(np.array(tokens), 2, 32, 4) == reference(tokens, 2, 32, 4)


def test_the_workers_proposer_caps_what_it_proposes():
    proposer = NgramProposer(min_n=1, max_n=3)
    assert proposer.propose([1, 2, 3, 1, 2], 2) == [3, 1]
    assert proposer.propose(np.array([4, 4]), 5) == [4]
    assert proposer.propose([], 3) == [] and proposer.propose([5, 6], 3) == []
    assert proposer.propose([1, 2, 3, 1, 2], 0) == []
