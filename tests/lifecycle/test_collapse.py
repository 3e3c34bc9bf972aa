"""The collapse alarm's arithmetic (``lifecycle.collapse``): windows of drafts, a fall to nothing after a
clearly higher window trips it; a slow drift or a window that was already low does not."""

from __future__ import annotations

from vllm_specrl.lifecycle.collapse import CollapseDetector


def feed(detector: CollapseDetector, accepted_per_draft: list[int]) -> list[dict]:
    return [v for a in accepted_per_draft if (v := detector.observe([(3, a)])) is not None]


def test_an_emptied_drafter_trips_it_within_one_window():
    detector = CollapseDetector(window=4)
    verdicts = feed(detector, [1, 2, 1, 0] + [0, 0, 0, 0])
    assert [v["collapsed"] for v in verdicts] == [False, True]
    assert verdicts[1]["length"] == 1.0 and verdicts[1]["previous"] == 2.0


def test_a_slow_drift_never_trips_it():
    detector = CollapseDetector(window=4)
    pattern = [2, 1, 1, 1] * 3 + [1, 1, 0, 1] * 3 + [1, 0, 0, 1] * 3
    assert not any(v["collapsed"] for v in feed(detector, pattern))


def test_the_margin_is_inclusive_and_a_window_that_accepted_nothing_before_never_trips_it():
    detector = CollapseDetector(window=4, below=1.05, drop=0.25)
    verdicts = feed(detector, [0, 0, 1, 0] + [0, 0, 0, 0])  # 1.25 -> 1.0: a fall of 0.25 from below 1.3
    assert verdicts[1]["collapsed"]  # exactly the margin: it trips
    detector = CollapseDetector(window=4)
    assert not feed(detector, [0, 0, 0, 0] * 2)[1]["collapsed"]  # nothing accepted before either
