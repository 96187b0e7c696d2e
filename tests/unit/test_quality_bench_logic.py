"""The pure parts of `bench.quality`: the sliding windows that score every token of the
held-out text exactly once, the perplexity arithmetic, the copy-task prompts, the
structured-output cases (valid JSON schemas, a prompt each) and the check for empty values."""

import math

import jsonschema
import pytest

from bench.quality_ppl import Window, heldout_text, paragraphs, perplexity, scored, windows
from bench.quality_spec import TASKS, copy_prompts, typos
from bench.quality_tasks import empty_values, structured_cases


@pytest.mark.parametrize("length", [5, 512, 513, 700, 1300, 3220])
def test_windows_score_each_token_after_the_first_once_with_enough_context(length):
    ids = list(range(length))
    wins = windows(ids, size=512, stride=256)
    assert wins[0].tokens[0] == 0 and wins[-1].tokens[-1] == length - 1
    # Fake log-probs naming the token they score: entry j of a window is its token j + 1.
    per_window = [[float(t) for t in w.tokens[1:]] for w in wins]
    got = scored(per_window, wins)
    assert got == [float(t) for t in range(1, length)]
    for w in wins[1:]:  # a later window's first scored token has 256 or more before it
        assert w.first_scored >= 256 and len(w.tokens) == 512


def test_scored_refuses_a_window_of_the_wrong_length():
    with pytest.raises(AssertionError):
        scored([[0.0, 0.0]], [Window((1, 2, 3, 4), 1)])


def test_perplexity_is_exp_of_the_mean_negative_log_prob():
    assert perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    assert perplexity([0.0, math.log(0.25)]) == pytest.approx(2.0)


def test_the_heldout_text_is_a_few_thousand_words_without_its_header():
    text = heldout_text()
    assert not any(line.startswith("#") for line in text.splitlines())
    assert 2000 <= len(text.split()) <= 6000
    assert len(paragraphs()) >= 10


def test_typos_swap_the_middle_letters_of_every_sixth_word_and_nothing_else():
    text = "alpha bravo charlie delta foxtrot golfing hotel indigo juliet kilos"
    got = typos(text)
    changed = [(a, b) for a, b in zip(text.split(), got.split(), strict=True) if a != b]
    assert changed == [("golfing", "gofling")]  # the 6th word, its middle pair swapped
    assert sorted(got) == sorted(text)


def test_copy_prompts_take_each_task_in_turn_over_body_paragraphs():
    prompts = copy_prompts(8)
    assert [task for task, _ in prompts] == list(TASKS) * 2
    assert all(len(message) > 150 for _, message in prompts)


def test_every_structured_case_is_a_valid_schema_with_a_prompt():
    cases = structured_cases()
    assert len(cases) >= 10 and len({c["name"] for c in cases}) == len(cases)
    for case in cases:
        jsonschema.Draft202012Validator.check_schema(case["schema"])
        assert case["prompt"].strip()


def test_empty_values_names_the_path_of_each_empty_string_array_and_object():
    value = {"a": " ", "b": [], "c": {"d": {}, "e": ["x", ""]}, "f": 0, "g": False}
    assert empty_values(value) == ["$.a", "$.b", "$.c.d", "$.c.e[1]"]
    assert empty_values({"name": "Ada", "items": [{"q": 1}]}) == []
