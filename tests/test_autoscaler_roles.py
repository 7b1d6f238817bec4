"""A disaggregated fleet's prefill and decode pools, each sized on its own signal
(services/autoscaler/roles.py; the policy's `signals`, the aggregator's role filter)."""

from __future__ import annotations

import pytest

from proto import messages as m
from services.autoscaler.policy import AutoscalePolicy, PolicyConfig
from services.autoscaler.roles import ROLE_SIGNALS, DisaggregatedPolicy, RoleBounds, role_configs, role_pool
from services.autoscaler.settings import AutoscalerSettings
from services.autoscaler.signals import PoolSignals, SignalAggregator
from services.worker.prefill_timing import prefill_ttft

POOL = "llama"
BASE = PolicyConfig(ttft_slo_s=0.8, tpot_slo_s=0.04, headroom=0.15, scale_down_window_s=300.0)
PREFILL = RoleBounds(goodput_rps=10.0, max_serving=40, max_warm=4, max_replicas=44)
DECODE = RoleBounds(goodput_rps=5.0, max_serving=60, max_warm=6, max_replicas=66)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _policy(clock: Clock) -> DisaggregatedPolicy:
    return DisaggregatedPolicy(clock, role_configs(BASE, prefill=PREFILL, decode=DECODE, prefill_ttft_budget_s=0.6,
                                                   decode_kv_budget=0.9))


def _signals(role: str, serving: int, rate: float, **extra: object) -> PoolSignals:
    """A pool within every budget unless `extra` says otherwise."""
    values: dict[str, object] = dict(pool=role_pool(POOL, role), serving=serving, arrival_rate=rate, ttft_p90_s=0.3,
                                     tpot_p90_s=0.02, queue_wait_s=0.01, kv_usage=0.4, slots=256 * serving)
    values.update(extra)
    return PoolSignals(**values)  # type: ignore[arg-type]


def test_each_pool_is_sized_on_its_own_goodput() -> None:
    # 100 req/s through both: prefill ⌈100 × 1.15 ÷ 10⌉ = 12, decode ⌈100 × 1.15 ÷ 5⌉ = 23.
    clock = Clock()
    policy = _policy(clock)
    both = policy.decide_both(_signals("prefill", 12, 100.0), _signals("decode", 23, 100.0))
    assert (both["prefill"].desired_serving, both["decode"].desired_serving) == (12, 23)
    assert both["prefill"].direction == both["decode"].direction == "hold"
    assert both["prefill"].pool == "llama:prefill" and both["decode"].pool == "llama:decode"


def test_prefill_scales_on_its_ttft_budget_share_and_decode_holds() -> None:
    # 700 ms is within the client's 800 ms TTFT SLO but over the prefill's 600 ms share.
    policy = _policy(Clock())
    both = policy.decide_both(_signals("prefill", 12, 100.0, ttft_p90_s=0.7), _signals("decode", 23, 100.0))
    assert both["prefill"].direction == "up" and both["prefill"].desired_serving == 14  # ⌈12 × 0.7/0.6⌉
    assert "p90 TTFT 700 ms > 600 ms" in both["prefill"].reason
    assert both["decode"].direction == "hold" and both["decode"].desired_serving == 23


def test_prefill_scales_on_its_queue() -> None:
    policy = _policy(Clock())
    decision = policy.decide("prefill", _signals("prefill", 12, 100.0, queue_wait_s=1.0))
    assert decision.direction == "up" and decision.desired_serving == 24  # ×2 (1.0 s ÷ 0.5 s budget)


def test_prefill_ignores_tpot_and_kv() -> None:
    # A prefill worker decodes nothing and frees its KV once sent: neither says it is short.
    policy = _policy(Clock())
    decision = policy.decide("prefill", _signals("prefill", 12, 100.0, tpot_p90_s=0.2, kv_usage=1.0))
    assert decision.direction == "hold" and decision.desired_serving == 12


def test_decode_scales_on_tpot_and_prefill_holds() -> None:
    policy = _policy(Clock())
    both = policy.decide_both(_signals("prefill", 12, 100.0), _signals("decode", 23, 100.0, tpot_p90_s=0.05))
    assert both["decode"].direction == "up" and both["decode"].desired_serving == 29  # ⌈23 × 50/40⌉
    assert both["prefill"].direction == "hold" and both["prefill"].desired_serving == 12


def test_decode_scales_on_kv_use_over_its_budget() -> None:
    policy = _policy(Clock())
    decision = policy.decide("decode", _signals("decode", 23, 100.0, kv_usage=0.99))
    assert decision.direction == "up" and decision.desired_serving == 26  # ⌈23 × 0.99/0.9⌉
    assert "KV 99% > 90%" in decision.reason
    calm = _policy(Clock()).decide("decode", _signals("decode", 23, 100.0, kv_usage=0.85))
    assert calm.direction == "hold"


def test_decode_ignores_ttft_and_queue_wait() -> None:
    # A decode worker holds a request while its prefill runs elsewhere: a long TTFT or queue wait
    # there is the prefill pool's shortage, and more decode replicas would not fix it.
    policy = _policy(Clock())
    decision = policy.decide("decode", _signals("decode", 23, 100.0, ttft_p90_s=2.0, queue_wait_s=2.0))
    assert decision.direction == "hold" and decision.desired_serving == 23


def test_the_pools_keep_their_own_bounds_and_state() -> None:
    clock = Clock()
    policy = _policy(clock)
    # Far more than either maximum: each is capped at its own.
    both = policy.decide_both(_signals("prefill", 12, 1000.0), _signals("decode", 23, 1000.0))
    assert (both["prefill"].desired_serving, both["decode"].desired_serving) == (40, 60)
    # A decode step-up's cooldown does not hold back the prefill pool's first step.
    clock.t += 1
    policy = _policy(clock)
    policy.decide("decode", _signals("decode", 23, 100.0, tpot_p90_s=0.08))
    clock.t += 1
    decision = policy.decide("prefill", _signals("prefill", 12, 100.0, ttft_p90_s=0.9))
    assert decision.direction == "up"


def test_an_aggregated_pool_reads_all_its_latencies_and_not_kv() -> None:
    assert BASE.signals == ("ttft", "tpot", "queue")
    policy = AutoscalePolicy(Clock(), BASE)
    calm = _signals("decode", 23, 100.0, kv_usage=1.0)
    assert policy.pressure(calm)[0] < 1
    for breach in (dict(ttft_p90_s=0.9), dict(tpot_p90_s=0.05), dict(queue_wait_s=0.6)):
        assert policy.pressure(_signals("decode", 23, 100.0, **breach))[0] > 1, breach


def test_role_configs_and_signal_names_are_checked() -> None:
    assert ROLE_SIGNALS == {"prefill": ("ttft", "queue"), "decode": ("tpot", "kv")}
    with pytest.raises(ValueError, match="signals"):
        PolicyConfig(signals=("ttft", "gpu"))
    with pytest.raises(ValueError, match="kv_budget"):
        PolicyConfig(kv_budget=1.5)
    with pytest.raises(ValueError, match="TTFT budget"):
        role_configs(BASE, prefill=PREFILL, decode=DECODE, prefill_ttft_budget_s=0, decode_kv_budget=0.9)
    with pytest.raises(ValueError, match="need a config"):
        DisaggregatedPolicy(Clock(), {"prefill": BASE})


def _load(worker_id: str, role: str, t: float, seq: int, in_flight: int, kv_used: int) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker_id, model=POOL, ts=t, seq=seq, running=in_flight, waiting=0,
                        in_flight=in_flight, max_running=256, kv_used_tokens=kv_used, kv_capacity_tokens=1000,
                        completed=seq * 5, role=role)


def test_the_aggregator_keeps_each_roles_workers_apart() -> None:
    clock = Clock()
    aggregator = SignalAggregator(clock)
    for seq in range(5):
        clock.t = 1000.0 + seq
        aggregator.on_load(_load("p-1", "prefill", clock.t, seq, 3, 100))
        aggregator.on_load(_load("d-1", "decode", clock.t, seq, 40, 950))
        aggregator.on_load(_load("d-2", "decode", clock.t, seq, 30, 500))
    prefill = aggregator.snapshot(POOL, "prefill", role_pool(POOL, "prefill"))
    decode = aggregator.snapshot(POOL, "decode", role_pool(POOL, "decode"))
    assert (prefill.pool, prefill.serving, prefill.in_flight, prefill.kv_usage) == ("llama:prefill", 1, 3, 0.1)
    assert (decode.pool, decode.serving, decode.in_flight, decode.kv_usage) == ("llama:decode", 2, 70, 0.95)
    assert aggregator.snapshot(POOL).serving == 3  # an aggregated pool: every worker of the model


def _decode_bound_reports(clock: Clock, aggregator: SignalAggregator) -> None:
    """Ten seconds of a decode-bound fleet as its workers report it: two decode workers with their
    KV 97% used and p90 TPOT 60 ms (over the 40 ms SLO), so requests wait 2.5 s for a decode slot
    before a decode worker takes them; two prefill workers, each prompt 0.3 s from the decode
    worker's ask to its KV sent. The prefill workers' TTFT is what they observe (prefill_timing)."""
    rate = 1.5  # req/s through each worker: within one replica of either pool by capacity
    ttft = {w: [] for w in ("p-1", "p-2")}  # type: dict[str, list[int]]
    tpot = {w: [] for w in ("d-1", "d-2")}  # type: dict[str, list[int]]
    queue = {w: [] for w in ("d-1", "d-2")}  # type: dict[str, list[int]]
    done = 0
    for seq in range(21):
        clock.t = 1000.0 + seq * 0.5
        now = clock.t
        for prefill, decode in (("p-1", "d-1"), ("p-2", "d-2")):
            for _ in range(int(rate * 0.5 * 2) if seq else 0):
                created = now - 2.8
                request = m.InferenceRequest(
                    request_id=f"r{done}",
                    tenant="t",
                    model=POOL,
                    prompt="x",
                    sampling=m.SamplingParams(max_new_tokens=8),
                    reply_to="g",
                    deadline=now + 60,
                    created=created,
                )
                ask = m.PrefillRequest(request=request, bootstrap_room=done, asked_at=created + 2.5)
                m.observe(ttft[prefill], m.LATENCY_BUCKETS_S, prefill_ttft(ask, now))
                m.observe(queue[decode], m.LATENCY_BUCKETS_S, 2.5)
                m.observe(tpot[decode], m.TPOT_BUCKETS_S, 0.06)
                done += 1
            aggregator.on_load(m.WorkerLoad(
                worker_id=prefill, model=POOL, ts=now, seq=seq, running=1, waiting=0, in_flight=1, max_running=256,
                kv_used_tokens=10, kv_capacity_tokens=1000, completed=done // 2, role="prefill",
                ttft_hist=list(ttft[prefill])))
            aggregator.on_load(m.WorkerLoad(
                worker_id=decode, model=POOL, ts=now, seq=seq, running=40, waiting=0, in_flight=40, max_running=40,
                kv_used_tokens=970, kv_capacity_tokens=1000, completed=done // 2, role="decode",
                queue_wait_hist=list(queue[decode]), tpot_fine_hist=list(tpot[decode])))


def test_a_decode_shortage_grows_decode_and_not_prefill_under_the_default_budgets() -> None:
    # The shipped defaults (600 ms prefill TTFT budget, 500 ms queue budget): requests that wait
    # 2.5 s for a decode worker must not read as the prefill pool's TTFT.
    settings = AutoscalerSettings(disaggregated=True)
    clock = Clock()
    aggregator = SignalAggregator(clock)
    _decode_bound_reports(clock, aggregator)
    prefill = aggregator.snapshot(POOL, "prefill", role_pool(POOL, "prefill"))
    decode = aggregator.snapshot(POOL, "decode", role_pool(POOL, "decode"))
    assert prefill.ttft_p90_s is not None and prefill.ttft_p90_s < settings.prefill_ttft_budget_s
    assert decode.tpot_p90_s is not None and decode.tpot_p90_s > settings.tpot_slo_s and decode.kv_usage > 0.9
    both = DisaggregatedPolicy(clock, settings.role_configs()).decide_both(prefill, decode)
    assert both["decode"].direction == "up" and both["decode"].desired_serving > 2, both["decode"].reason
    assert "p90 TPOT" in both["decode"].reason and "KV 97%" in both["decode"].reason
    assert both["prefill"].direction == "hold" and both["prefill"].desired_serving == 2, both["prefill"].reason


def test_the_prefill_pools_ttft_starts_at_the_decode_workers_ask() -> None:
    request = m.InferenceRequest(
        request_id="r",
        tenant="t",
        model=POOL,
        prompt="x",
        sampling=m.SamplingParams(max_new_tokens=8),
        reply_to="g",
        deadline=2000.0,
        created=1000.0,
    )
    # Asked 2.5 s after the gateway's accept (the wait for a decode slot), KV sent 0.3 s later.
    assert prefill_ttft(m.PrefillRequest(request=request, bootstrap_room=1, asked_at=1002.5), 1002.8) == pytest.approx(
        0.3
    )
    # A decode worker that does not say: from the gateway's accept.
    assert prefill_ttft(m.PrefillRequest(request=request, bootstrap_room=1), 1002.8) == pytest.approx(2.8)
