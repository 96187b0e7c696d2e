"""The scheduler's record of prefill -> decode links that just failed a transfer."""

from services.scheduler.link_breaker import LinkBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_link_is_avoided_for_its_cool_down_then_tried_again():
    clock = Clock()
    links = LinkBreaker(cool_down_s=10, clock=clock)
    assert links.failed("p", "far") == 10
    assert links.broken("p", "far")
    assert not links.broken("p", "near") and not links.broken("q", "far")
    assert links.usable("p", ["far", "near"]) == [1]
    clock.now += 10.5
    assert not links.broken("p", "far")
    assert links.usable("p", ["far", "near"]) == [0, 1]


def test_failures_in_a_row_double_the_cool_down_up_to_the_cap_and_a_success_resets():
    clock = Clock()
    links = LinkBreaker(cool_down_s=10, max_cool_down_s=35, clock=clock)
    cool_downs = []
    for _ in range(4):
        cool_downs.append(links.failed("p", "far"))
        clock.now += cool_downs[-1] + 0.1  # each failure comes when the pair is tried again
    assert cool_downs == [10, 20, 35, 35]
    links.succeeded("p", "far")
    assert links.failed("p", "far") == 10


def test_transfers_failing_together_count_once():
    clock = Clock()
    links = LinkBreaker(cool_down_s=10, clock=clock)
    assert links.failed("p", "far") == 10
    clock.now += 1
    assert links.failed("p", "far") == 9  # the same break: not lengthened, not escalated
    clock.now += 9.5
    assert links.failed("p", "far") == 20  # a new failure after the pair was retried


def test_with_every_link_broken_all_are_usable_and_a_worker_coming_back_is_clean():
    links = LinkBreaker(cool_down_s=10, clock=Clock())
    links.failed("p", "a")
    links.failed("p", "b")
    links.failed("q", "a")
    assert links.usable("p", ["a", "b"]) == [0, 1]  # a request must go somewhere
    links.forget("a")
    assert not links.broken("p", "a") and not links.broken("q", "a")
    assert links.broken("p", "b")
