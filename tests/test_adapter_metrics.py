"""Per-adapter metrics name the busiest adapters only: bounded series however many adapters exist."""

from __future__ import annotations

import pytest

from services.gateway.adapter_metrics import OTHER, TopLabels


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_first_adapters_are_named_until_the_top_is_full_then_the_rest_are_other() -> None:
    labels = TopLabels(Clock(), top=2, refresh_s=60.0)
    assert labels.label("a") == ("a", [])
    assert labels.label("b") == ("b", [])
    assert labels.label("c") == (OTHER, [])


def test_a_rising_adapter_takes_the_place_of_a_fading_one_at_the_next_rerank() -> None:
    clock = Clock()
    labels = TopLabels(clock, top=2, half_life_s=10.0, refresh_s=5.0)
    for _ in range(5):
        labels.label("a")
        labels.label("b")
    clock.now = 1.0
    for _ in range(3):
        assert labels.label("c")[0] == OTHER  # not yet re-ranked
    clock.now = 30.0  # a and b have faded (three half-lives); c keeps going
    for _ in range(5):
        labels.label("c")
    label, _ = labels.label("c")
    assert label == "c" and "c" in labels.named
    assert len(labels.named) <= 2


@pytest.mark.slow
def test_series_stay_bounded_over_a_thousand_adapters() -> None:
    clock = Clock()
    labels = TopLabels(clock, top=20, refresh_s=1.0)
    seen: set[str] = set()
    for i in range(20_000):
        clock.now = i * 0.01
        label, _ = labels.label(f"adapter-{(i * 7919) % 1000}")
        seen.add(label)
        assert len(labels.named) <= 20
    assert OTHER in seen
