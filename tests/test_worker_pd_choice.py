"""A worker's pure decisions in prefill/decode disaggregation: its role, its engine's bootstrap
address, the prefill worker a decode worker falls back on, and when a failed prefill is retried."""

from __future__ import annotations

import random

import pytest

from proto import messages as m
from services.worker import prefill_choice
from services.worker.prefill_choice import PrefillPeer, fallback, retry, usable
from services.worker.roles import bootstrap_address, engine_role, resolve_role


def request(**fields: object) -> m.InferenceRequest:
    base: dict[str, object] = dict(request_id="r", tenant="t", model="m", prompt="", reply_to="inferbus.tok.g",
                                   deadline=1e12, created=0.0, sampling=m.SamplingParams(max_new_tokens=4))
    base.update(fields)
    return m.InferenceRequest(**base)  # type: ignore[arg-type]


def test_the_role_is_the_engines_and_a_contradicting_setting_is_refused() -> None:
    assert engine_role({}) == "aggregated"
    assert engine_role({"disaggregation_mode": "null"}) == "aggregated"
    assert engine_role({"disaggregation_mode": "prefill"}) == "prefill"
    assert resolve_role("auto", {"disaggregation_mode": "decode"}) == "decode"
    assert resolve_role("decode", {"disaggregation_mode": "decode"}) == "decode"
    with pytest.raises(ValueError, match="engine runs as 'aggregated'"):
        resolve_role("decode", {"disaggregation_mode": "null"})


def test_bootstrap_address_is_the_engines_host_and_bootstrap_port_unless_set() -> None:
    info = {"disaggregation_bootstrap_port": 9123}
    pod_ip = lambda: "10.9.8.7"  # noqa: E731
    assert bootstrap_address(info, "http://10.0.0.5:30000", own=pod_ip) == ("10.0.0.5", 9123)
    assert bootstrap_address(info, "http://127.0.0.1:30000", "10.1.2.3", own=pod_ip) == ("10.1.2.3", 9123)
    assert bootstrap_address({}, "http://h:1", own=pod_ip) == ("h", 8998)  # SGLang's default port
    # The engine in the worker's own pod, on localhost: decode engines elsewhere reach it at the pod's IP.
    assert bootstrap_address(info, "http://127.0.0.1:30000", own=pod_ip) == ("10.9.8.7", 9123)
    assert bootstrap_address(info, "http://localhost:30000", own=pod_ip) == ("10.9.8.7", 9123)
    assert bootstrap_address(info, "http://127.0.0.1:30000", "127.0.0.1", own=pod_ip) == ("127.0.0.1", 9123)


def test_fallback_prefers_the_own_zone_then_the_fewest_halves_in_flight() -> None:
    peers = [PrefillPeer("a1", "m", "a"), PrefillPeer("a2", "m", "a"), PrefillPeer("b1", "m", "b"),
             PrefillPeer("other-model", "x", "a"), PrefillPeer("draining", "m", "a", ready=False)]
    rng = random.Random(0)
    assert fallback(peers, request(), "a", set(), {"a1": 3, "a2": 1}, rng) == "a2"
    assert fallback(peers, request(), "a", {"a2"}, {"a1": 3}, rng) == "a1"
    assert fallback(peers, request(), "a", {"a1", "a2"}, {}, rng) == "b1"  # none left in its zone: another zone
    assert fallback(peers, request(), "a", {"a1", "a2", "b1"}, {}, rng) is None
    picks = {fallback(peers, request(), "", set(), {}, random.Random(seed)) for seed in range(20)}
    assert picks == {"a1", "a2", "b1"}  # ties at random


def test_a_pinned_release_takes_prefill_workers_of_that_release_only() -> None:
    assert usable(PrefillPeer("p", "m", release="r1"), request(release="r1"), set())
    assert not usable(PrefillPeer("p", "m", release="r2"), request(release="r1"), set())
    assert usable(PrefillPeer("p", "m", release="r2"), request(), set())


def test_retry_only_before_the_first_token_and_within_tries_and_deadline() -> None:
    ok = dict(code="prefill_aborted", got_first_token=False, cancelled=False, tries=1, now=0.0, deadline=10.0)
    assert retry(**ok)  # type: ignore[arg-type]
    assert not retry(**{**ok, "got_first_token": True})  # type: ignore[arg-type]
    assert not retry(**{**ok, "cancelled": True})  # type: ignore[arg-type]
    assert not retry(**{**ok, "tries": prefill_choice.MAX_TRIES})  # type: ignore[arg-type]
    assert not retry(**{**ok, "now": 10.0})  # type: ignore[arg-type]
    assert not retry(**{**ok, "code": "invalid_request"})  # type: ignore[arg-type]


def test_a_preempted_batch_prefill_is_handed_back_not_retried() -> None:
    args = dict(got_first_token=False, cancelled=False, tries=1, now=0.0, deadline=10.0)
    assert not prefill_choice.retry(code="preempted", batch=True, **args)  # type: ignore[arg-type]
    assert prefill_choice.handed_back(code="preempted", batch=True)
    # An interactive half is never preempted; were one reported so, it is tried again elsewhere.
    assert prefill_choice.retry(code="preempted", batch=False, **args)  # type: ignore[arg-type]
    assert not prefill_choice.handed_back(code="preempted", batch=False)
    # A batch half that failed otherwise is tried again as any half.
    assert prefill_choice.retry(code="prefill_aborted", batch=True, **args)  # type: ignore[arg-type]
    assert not prefill_choice.handed_back(code="prefill_aborted", batch=True)
