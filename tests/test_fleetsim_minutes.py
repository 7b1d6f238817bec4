"""The minutes-in-SLO rule of the fleet simulator's time series, where it is decided
(`timeseries.close` judges a minute, `minute_attainment` counts them): a minute is within the SLO
when its p90 TTFT and p90 TPOT (nearest rank) are at most the SLO's, a shed request counts as an
infinite TTFT, and minutes without requests do not count."""

from __future__ import annotations

import math

import pytest

from tools.capacity.fleetsim.timeseries import INF, Bucket, Minute, close, minute_attainment

SLO_TTFT, SLO_TPOT = 0.8, 0.04


def minute(ttft: list[float], tpot: list[float] | None = None, *, arrivals: int | None = None) -> Minute:
    bucket = Bucket(3)
    bucket.ttft = list(ttft)
    bucket.tpot = list(tpot or [])
    bucket.arrivals = len(ttft) if arrivals is None else arrivals
    bucket.completed = sum(1 for t in ttft if t < INF)
    bucket.rejected = sum(1 for t in ttft if t == INF)
    return close(bucket, 60.0, SLO_TTFT, SLO_TPOT, serving=2, started=2, kv_use=0.5, queued=0)


def test_a_minute_whose_p90s_are_within_is_within() -> None:
    judged = minute([0.1] * 9 + [0.8], [0.02] * 9 + [0.04])  # p90 of 10 by nearest rank: the 9th value
    assert judged.within_slo
    assert (judged.ttft_p90_s, judged.tpot_p90_s, judged.t_s) == (0.1, 0.02, 180.0)


def test_a_p90_ttft_over_the_slo_puts_the_minute_out() -> None:
    assert not minute([0.1] * 8 + [0.81, 0.9], [0.02] * 10).within_slo
    assert minute([0.1] * 8 + [0.8, 0.9], [0.02] * 10).within_slo  # at the SLO is within


def test_a_p90_tpot_over_the_slo_puts_the_minute_out() -> None:
    assert not minute([0.1] * 10, [0.02] * 8 + [0.041, 0.05]).within_slo
    assert minute([0.1] * 10, [0.02] * 8 + [0.04, 0.05]).within_slo


def test_shed_requests_count_as_an_infinite_ttft() -> None:
    assert minute([0.1] * 9 + [INF]).within_slo  # one in ten shed: p90 is still the 9th value
    judged = minute([0.1] * 8 + [INF, INF])
    assert not judged.within_slo and judged.ttft_p90_s == INF


def test_a_minute_of_single_token_answers_is_judged_on_ttft_alone() -> None:
    assert minute([0.1] * 5, []).within_slo
    assert not minute([0.9] * 5, []).within_slo


def test_attainment_is_the_share_of_minutes_with_requests_within_the_slo() -> None:
    good, bad, idle = minute([0.1]), minute([2.0]), minute([], arrivals=0)
    assert idle.within_slo and math.isnan(idle.ttft_p90_s)  # nothing to judge
    assert minute_attainment([good, bad, idle, good]) == (3, pytest.approx(2 / 3))
    assert minute_attainment([idle]) == (0, pytest.approx(math.nan, nan_ok=True))
    assert minute_attainment([bad, bad]) == (2, 0.0)
