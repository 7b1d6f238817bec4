"""The autoscaler's pure core: signals from load reports, the forecast, the policy, the reconciler."""

from __future__ import annotations

import dataclasses

import pytest

from inferbus.runtime import settings as settings_mod
from proto import messages as m
from services.autoscaler.forecast import HoltForecaster
from services.autoscaler.policy import AutoscalePolicy, PolicyConfig, Reconciler
from services.autoscaler.settings import AutoscalerSettings
from services.autoscaler.signals import PoolSignals, SignalAggregator

POOL = "llama"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def policy(clock: Clock, **config: object) -> AutoscalePolicy:
    return AutoscalePolicy(clock, PolicyConfig(**config))  # type: ignore[arg-type]


def calm(serving: int, rate: float, **extra: object) -> PoolSignals:
    values: dict[str, object] = dict(pool=POOL, serving=serving, arrival_rate=rate, ttft_p90_s=0.3, tpot_p90_s=0.02,
                                     queue_wait_s=0.01, slots=256 * serving)
    values.update(extra)
    return PoolSignals(**values)  # type: ignore[arg-type]


# ---- SLO pressure ------------------------------------------------------------------------------


def test_ttft_and_queue_pressure_scale_up_with_the_signal_values_in_the_reason() -> None:
    clock = Clock()
    p = policy(clock)
    d = p.decide(calm(12, 40.0, ttft_p90_s=0.91, queue_wait_s=1.4))
    assert d.direction == "up" and d.desired_serving > 12
    # ×pressure (queue wait 1.4 s over a 0.5 s budget = 2.8), at most doubled in one step.
    assert d.desired_serving == 24
    assert d.reason.startswith("scale up 12→24: p90 TTFT 910 ms > 800 ms, queue wait 1.40 s > 0.50 s")
    assert "slo" in d.causes


def test_pressure_step_is_proportional_and_at_least_one() -> None:
    clock = Clock()
    p = policy(clock)
    d = p.decide(calm(10, 30.0, ttft_p90_s=0.88))  # 10% over the SLO
    assert d.desired_serving == 11
    assert "p90 TTFT 880 ms > 800 ms" in d.reason


def test_tpot_pressure_counts_too() -> None:
    d = policy(Clock()).decide(calm(4, 8.0, tpot_p90_s=0.06))
    assert d.direction == "up" and d.desired_serving == 6
    assert "p90 TPOT 60 ms > 40 ms" in d.reason


def test_pressure_does_not_stack_during_the_cooldown() -> None:
    clock = Clock()
    p = policy(clock, slo_cooldown_s=15.0)
    assert p.decide(calm(4, 8.0, ttft_p90_s=1.2)).desired_serving == 6
    # The windowed p90 still shows the breach while the new replicas start: hold, do not add more.
    clock.t += 5
    d = p.decide(calm(4, 8.0, ttft_p90_s=1.2, starting=2))
    assert d.desired_serving == 6 and d.direction == "hold"
    assert "cooling down" in d.reason
    clock.t += 11  # past the cooldown but the new replicas only now serve: the cooldown runs from here
    d = p.decide(calm(6, 8.0, ttft_p90_s=1.2))
    assert d.desired_serving == 6 and d.direction == "hold"
    clock.t += 15  # they served for a cooldown and the breach persists: step again
    d = p.decide(calm(6, 8.0, ttft_p90_s=1.2))
    assert d.direction == "up" and d.desired_serving == 9


def test_pressure_waits_for_replicas_still_starting_then_gives_up_waiting() -> None:
    clock = Clock()
    p = policy(clock, slo_cooldown_s=15.0, cold_start_s=120.0)
    assert p.decide(calm(4, 8.0, ttft_p90_s=1.2)).desired_serving == 6
    # A cold start takes minutes; the backlog (and the pressure) grows meanwhile. Not ordered twice.
    for _ in range(26):
        clock.t += 5
        d = p.decide(calm(4, 8.0, ttft_p90_s=4.0, starting=2))
        assert d.desired_serving == 6, clock.t
    clock.t += 10  # raised at t = 0, now 140: overdue (cold start + cooldown), so pressure steps again
    d = p.decide(calm(4, 8.0, ttft_p90_s=4.0, starting=2))
    assert d.direction == "up" and d.desired_serving == 8


def test_warm_pool_covers_the_largest_recent_burst() -> None:
    clock = Clock()
    p = policy(clock, goodput_rps=4.0, headroom=0.0, cold_start_s=60.0, max_warm=32, burst_memory_s=600.0)
    rate = 20.0
    for i in range(100):  # flat, a jump from 20 to 40 req/s, flat again
        if i == 20:
            rate = 40.0
        d = p.decide(calm(p.replicas_for(rate), rate))
        clock.t += 5
    # 400 s after the jump (the trend flat, the scale-down window past), it is still remembered:
    # demand outgrew the target of a cold start before (5 replicas) at least ×2 → ≥ 10 warm
    # beside the 10 serving.
    assert d.desired_serving <= 11  # 10, or 11 while the forecast's overshoot of the jump is in the window
    assert d.desired_warm >= 10
    assert "in the last 600 s" in d.reason and "demand outgrew the serving target" in d.reason
    for _ in range(150):  # beyond the memory and the scale-down window: the pool shrinks back
        d = p.decide(calm(p.replicas_for(rate), rate))
        clock.t += 5
    assert d.desired_warm <= 1


def test_gpu_utilisation_is_not_a_signal_kv_is_reported() -> None:
    # A busy fleet meeting its SLO is the goal, not a reason to scale.
    d = policy(Clock()).decide(calm(4, 10.0, kv_usage=0.93, running=900))
    assert d.direction == "hold" and d.desired_serving == 4
    assert "KV 93%" in d.reason


# ---- capacity and forecast ---------------------------------------------------------------------


def test_capacity_from_demand_over_per_replica_goodput() -> None:
    p = policy(Clock(), goodput_rps=4.1, headroom=0.15)
    assert p.replicas_for(833.0) == 234  # ⌈833 × 1.15 / 4.1⌉, the capacity plan's rule
    d = p.decide(calm(2, 20.0))
    assert d.direction == "up" and d.desired_serving == 6 and "capacity" in d.causes
    assert "20.0 req/s (forecast 20.0) needs 6 at 4.1 req/s each +15%" in d.reason


def test_capacity_of_a_pooled_pool_uses_the_goodput_of_the_replicas_serving() -> None:
    """A prompt waits for the first free replica of those serving (the router pools their prefill
    queues): one replica's goodput grows with the pool, so the plan's number for its own pool size
    over-promises at a trough."""
    table = ((1, 1.0), (4, 1.5), (8, 2.0))
    config = PolicyConfig(goodput_rps=2.0, goodput_by_serving=table, headroom=0.0)
    # Each size range with its own goodput: 3 × 1.0, 4 × 1.5 (3 × 1.0 is short of 3.5), 8 × 2.0
    # (7 would serve at 1.5: 10.5).
    assert [config.serving_for(r) for r in (0.0, 3.0, 3.5, 6.0, 6.5, 13.0, 16.0, 16.5)] == [0, 3, 4, 4, 5, 8, 8, 9]
    assert [config.goodput_at(n) for n in (0, 1, 3, 4, 7, 8, 100)] == [1.0, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0]
    # The plan's one number at its size says 2 replicas for 3 req/s, where 2 pooled serve 2.
    assert PolicyConfig(goodput_rps=2.0, headroom=0.0).serving_for(3.0) == 2
    d = AutoscalePolicy(Clock(), dataclasses.replace(config, headroom=0.15)).decide(calm(2, 3.0))
    assert d.desired_serving == 4 and "needs 4 at 1.5 req/s each +15%" in d.reason  # ⌈3 × 1.15 ÷ 1.0⌉ = 4 ≥ 4
    assert d.capacity_rate == pytest.approx(4 * 1.5 / 1.15)
    with pytest.raises(ValueError, match="ascending"):
        PolicyConfig(goodput_by_serving=((4, 1.5), (1, 1.0)))


def test_forecast_on_a_ramp_starts_replicas_one_cold_start_ahead() -> None:
    clock = Clock()
    p = policy(clock, cold_start_s=120.0, warm_start_s=5.0, max_warm=64)
    rate, slope = 20.0, 0.2  # +0.2 req/s every second: +24 req/s over one cold start
    decision = None
    for _ in range(60):  # five minutes of ticks on the ramp
        decision = p.decide(calm(p.replicas_for(rate), rate))
        clock.t += 5
        rate += slope * 5
    assert decision is not None
    now_rate = rate - slope * 5
    later_need = p.replicas_for(now_rate + slope * 120)
    # What runs or is warm already covers the demand one cold start ahead...
    assert decision.desired_serving + decision.desired_warm >= later_need - 1
    # ...while the demand right now would need far fewer.
    assert p.replicas_for(now_rate) < later_need - 3
    # The forecast sees the trend: the serving target leads the current rate by the warm start.
    assert decision.forecast_rate > now_rate


def test_holt_forecaster_follows_a_linear_ramp() -> None:
    f = HoltForecaster(alpha=0.5, beta=0.2)
    for i in range(100):
        f.observe(i * 5.0, 10.0 + 0.5 * i * 5.0)
    assert f.ramp() == pytest.approx(0.5, rel=0.05)
    assert f.forecast(120.0) == pytest.approx(10.0 + 0.5 * (495.0 + 120.0), rel=0.03)
    f2 = HoltForecaster()
    assert f2.forecast(60) == 0.0
    with pytest.raises(ValueError, match="alpha"):
        HoltForecaster(alpha=0.0)


# ---- warm pool ---------------------------------------------------------------------------------


def test_warm_pool_is_sized_from_the_ramp_and_the_cold_start() -> None:
    clock = Clock()
    p = policy(clock, goodput_rps=4.0, headroom=0.0, cold_start_s=100.0, max_warm=32)
    rate = 40.0
    for _ in range(80):
        d = p.decide(calm(10 + int((rate - 40.0) / 4), rate))
        clock.t += 5
        rate += 0.1 * 5  # 0.1 req/s per second
    # ramp × cold start ÷ goodput = 0.1 × 100 / 4 = 2.5 → at least 3 warm replicas.
    assert d.desired_warm >= 3
    assert "warm" in d.reason


def test_flat_load_keeps_only_the_minimum_warm_pool() -> None:
    clock = Clock()
    p = policy(clock, min_warm=1)
    for _ in range(20):
        d = p.decide(calm(3, 10.0))
        clock.t += 5
    assert d.desired_warm == 1 and d.desired_serving == 3


def test_warm_pool_shrinks_only_after_the_window() -> None:
    clock = Clock()
    p = policy(clock, scale_down_window_s=60.0, min_warm=0, max_warm=10, burst_memory_s=0)
    rate = 10.0
    for _ in range(12):  # a ramp builds a warm pool
        d = p.decide(calm(p.replicas_for(rate), rate))
        clock.t += 5
        rate += 2.0
    built = d.desired_warm
    assert built >= 2
    d = p.decide(calm(p.replicas_for(rate), rate))  # the ramp ends: flat from here
    clock.t += 5
    d = p.decide(calm(p.replicas_for(rate), rate))
    assert d.desired_warm == built  # not at once
    for _ in range(20):
        clock.t += 5
        d = p.decide(calm(p.replicas_for(rate), rate))
    assert d.desired_warm < built


# ---- stabilisation, bounds, in-flight work -----------------------------------------------------


def test_scale_down_waits_for_a_window_of_sustained_low_load_then_steps_slowly() -> None:
    clock = Clock()
    p = policy(clock, scale_down_window_s=300.0, down_step_s=30.0, max_step_down=0.1, min_serving=2)
    for _ in range(70):  # busy for a while: 20 replicas' worth
        p.decide(calm(20, 70.0))
        clock.t += 5
    serving, history = 20, []
    for _ in range(120):  # ten minutes at a trickle
        d = p.decide(calm(serving, 2.0))
        history.append((clock.t, d))
        if d.direction == "down":
            serving = d.desired_serving
        clock.t += 5
    downs = [(t, d) for t, d in history if d.direction == "down"]
    first_low = history[0][0]
    assert downs and downs[0][0] - first_low >= 300.0 - 5  # not before the window
    assert all(d.serving - d.desired_serving <= 2 for _, d in downs)  # ≤ 10% (at least 1) per step
    gaps = [b[0] - a[0] for a, b in zip(downs, downs[1:])]
    assert all(g >= 30.0 for g in gaps)
    assert "scale down 20→18: low load for 300 s" in downs[0][1].reason
    assert serving >= 2 and history[-1][1].desired_serving >= 2


def test_a_spike_inside_the_window_resets_the_scale_down() -> None:
    clock = Clock()
    p = policy(clock, scale_down_window_s=60.0, down_step_s=1.0)
    for _ in range(20):
        p.decide(calm(10, 35.0))
        clock.t += 5
    for i in range(30):
        rate = 35.0 if i == 8 else 2.0  # one busy tick 40 s into the lull
        d = p.decide(calm(10, rate))
        assert d.direction != "down" or i >= 8 + 12, (i, d.reason)
        clock.t += 5


def test_no_scale_down_under_pressure() -> None:
    clock = Clock()
    p = policy(clock, scale_down_window_s=10.0, down_step_s=1.0)
    for _ in range(10):
        d = p.decide(calm(8, 1.0, ttft_p90_s=0.76))  # 95% of the SLO: not low load
        clock.t += 5
    assert d.desired_serving == 8


def test_min_and_max_bound_the_target() -> None:
    clock = Clock()
    p = policy(clock, min_serving=2, max_serving=5, max_replicas=6)
    d = p.decide(calm(0, 0.0))
    assert d.desired_serving == 2 and d.reason.startswith("scale up 0→2: minimum 2")
    d = p.decide(calm(2, 100.0, ttft_p90_s=3.0))
    assert d.desired_serving == 5 and "capped at 5" in d.reason
    clock.t += 30
    d = p.decide(calm(5, 100.0, ttft_p90_s=3.0))
    assert d.desired_serving == 5 and d.direction == "hold" and "at the maximum 5" in d.reason
    assert d.desired_serving + d.desired_warm <= 6  # warm pool within the GPU budget


def test_never_below_what_in_flight_work_needs() -> None:
    clock = Clock()
    p = policy(clock, scale_down_window_s=10.0, down_step_s=1.0, max_step_down=1.0)
    for _ in range(10):
        # No new arrivals, but 700 long requests still held: three engines' slots (256 each).
        d = p.decide(calm(6, 0.0, in_flight=700, slots=6 * 256))
        clock.t += 5
    assert d.desired_serving == 3


def test_batch_load_alone_does_not_scale_up() -> None:
    clock = Clock()
    p = policy(clock)
    for _ in range(10):
        d = p.decide(calm(2, 0.0, batch_rate=50.0, batch_in_flight=500, waiting=0, ttft_p90_s=None,
                          tpot_p90_s=None, queue_wait_s=0.0))
        clock.t += 5
    assert d.direction == "hold" and d.desired_serving == 2
    assert "batch in flight 500 (filler, not scaled for)" in d.reason


def test_config_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="min_serving"):
        PolicyConfig(min_serving=5, max_serving=2)
    with pytest.raises(ValueError, match="goodput_rps"):
        PolicyConfig(goodput_rps=0)
    with pytest.raises(ValueError, match="max_replicas"):
        PolicyConfig(max_serving=10, max_replicas=5)


def test_settings_errors_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERBUS_AUTOSCALER_ACTUATOR", "helm")
    with pytest.raises(SystemExit, match="dryrun, local, kubernetes"):
        settings_mod.load(AutoscalerSettings)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_ACTUATOR", "dryrun")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING", "1:2.0,4")
    with pytest.raises(SystemExit, match="got '4'.*INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING"):
        settings_mod.load(AutoscalerSettings)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING", "1:2.0, 4:2.5")
    assert settings_mod.load(AutoscalerSettings).policy_config().goodput_by_serving == ((1, 2.0), (4, 2.5))
    monkeypatch.delenv("INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_MIN_SERVING", "9")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_MAX_SERVING", "3")
    with pytest.raises(SystemExit, match="min_serving"):
        settings_mod.load(AutoscalerSettings)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_MIN_SERVING", "0")
    with pytest.raises(SystemExit, match="scaling from zero is not supported"):
        settings_mod.load(AutoscalerSettings)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_MIN_SERVING", "1")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_LOCAL_ENGINE", "{not json")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_ACTUATOR", "local")
    with pytest.raises(SystemExit, match="INFERBUS_AUTOSCALER_LOCAL_ENGINE is not JSON"):
        settings_mod.load(AutoscalerSettings)
    monkeypatch.delenv("INFERBUS_AUTOSCALER_LOCAL_ENGINE")
    monkeypatch.delenv("INFERBUS_AUTOSCALER_MIN_SERVING")
    monkeypatch.delenv("INFERBUS_AUTOSCALER_MAX_SERVING")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_ACTUATOR", "kubernetes")
    monkeypatch.setenv("INFERBUS_AUTOSCALER_POOLS", "a,b")
    with pytest.raises(SystemExit, match="pool=name"):
        settings_mod.load(AutoscalerSettings)
    monkeypatch.setenv("INFERBUS_AUTOSCALER_K8S_DEPLOYMENTS", "a=worker-a,b=worker-b")
    assert settings_mod.load(AutoscalerSettings).deployments() == {"a": "worker-a", "b": "worker-b"}


# ---- reconciler: promotion, demotion (drain), retirement ---------------------------------------


def _decision(p: AutoscalePolicy, signals: PoolSignals):  # type: ignore[no-untyped-def]
    return p.decide(signals)


def test_promotion_is_the_fast_path_and_is_not_repeated() -> None:
    clock = Clock()
    r = Reconciler(clock, pending_s=30.0)
    p = policy(clock, goodput_rps=4.0, headroom=0.0)
    signals = calm(2, 16.0, serving_ids=("w1", "w2"), warm=2, warm_ids=("w3", "w4"))
    d = p.decide(signals)
    assert d.desired_serving == 4
    plan = r.plan(d, signals, launched=4)
    assert plan.promote == ("w3", "w4") and not plan.demote
    clock.t += 1  # the workers have not reported serving yet: promote nobody twice
    plan = r.plan(d, signals, launched=4)
    assert plan.promote == ()


def test_missing_serving_capacity_launches_replicas_that_arrive_warm() -> None:
    clock = Clock()
    r = Reconciler(clock)
    p = policy(clock, goodput_rps=4.0, headroom=0.0)
    signals = calm(2, 24.0, serving_ids=("w1", "w2"))
    d = p.decide(signals)
    plan = r.plan(d, signals, launched=2)
    assert d.desired_serving == 6 and plan.replicas == 6 + d.desired_warm and plan.promote == ()


def test_scale_down_demotes_least_loaded_and_retires_only_idle_warm_replicas() -> None:
    clock = Clock()
    r = Reconciler(clock)
    p = policy(clock, scale_down_window_s=10.0, down_step_s=1.0, max_step_down=1.0, min_serving=1)
    busy = calm(3, 0.1, serving_ids=("idle", "mid", "busy"))  # least loaded first, as signals order them
    d = p.decide(busy)
    while d.direction != "down":
        clock.t += 5
        d = p.decide(busy)
    assert d.desired_serving == 1
    plan = r.plan(d, busy, launched=3)
    assert plan.demote == ("idle", "mid")  # they drain (finish their work), then turn warm
    assert plan.retire == () and plan.replicas == 3  # nothing is stopped while it holds work
    # Next tick: both still finishing (draining) — not demoted again, nothing stopped.
    draining = dataclasses.replace(busy, serving=1, draining=2, serving_ids=("busy",))
    plan = r.plan(p.decide(draining), draining, launched=3)
    assert plan.demote == () and plan.retire == ()
    # Once warm, the surplus is retired.
    warm = dataclasses.replace(busy, serving=1, warm=2, serving_ids=("busy",), warm_ids=("idle", "mid"))
    d = p.decide(warm)
    plan = r.plan(d, warm, launched=3)
    assert d.desired_warm == 0 and plan.retire == ("idle", "mid") and plan.replicas == 1


# ---- signals from load reports -----------------------------------------------------------------


def _load(worker: str, ts: float, **fields: object) -> m.WorkerLoad:
    values: dict[str, object] = dict(worker_id=worker, model=POOL, ts=ts, seq=int(ts * 10), running=0, waiting=0,
                                     in_flight=0, max_running=64, kv_used_tokens=0, kv_capacity_tokens=1000)
    values.update(fields)
    return m.WorkerLoad(**values)  # type: ignore[arg-type]


def _hist(bounds: tuple[float, ...], values: list[float]) -> list[int]:
    hist: list[int] = []
    for value in values:
        m.observe(hist, bounds, value)
    return hist


def test_percentile_interpolates_inside_a_bucket() -> None:
    bounds = (0.1, 0.2, 0.4)
    assert m.hist_percentile([0, 10, 0, 0], bounds, 0.9) == pytest.approx(0.19)
    assert m.hist_percentile([0, 0, 0, 5], bounds, 0.9) == 0.4  # beyond the last bound: at least that
    assert m.hist_percentile([0, 0, 0, 0], bounds, 0.9) is None
    assert _hist(bounds, [0.1, 0.15, 5.0]) == [1, 1, 0, 1]


def test_signals_from_worker_reports() -> None:
    clock = Clock(0.0)
    agg = SignalAggregator(clock, rate_window_s=10.0, latency_window_s=10.0, min_latency_samples=5)
    slow = [0.95] * 20  # every interactive request in the window waited ~1 s for its first token
    for t in range(0, 11):
        clock.t = float(t)
        # w1: 5 completions a second, queue growing by 1 a second, a batch request in flight.
        agg.on_load(_load("w1", clock.t, completed=5 * t + 2 * t, completed_batch=2 * t, in_flight=10 + t + 3,
                          batch_in_flight=3, waiting=4, running=10 + t - 1, kv_used_tokens=800,
                          ttft_hist=_hist(m.LATENCY_BUCKETS_S, slow[: 2 * t]),
                          queue_wait_hist=_hist(m.LATENCY_BUCKETS_S, [0.4] * (2 * t)),
                          tpot_fine_hist=_hist(m.TPOT_BUCKETS_S, [0.03] * (2 * t))))
        agg.on_load(_load("w2", clock.t, phase="warm", max_running=0))
        agg.on_load(_load("w3", clock.t, phase="starting", max_running=0))
        agg.on_load(_load("w4", clock.t, draining=True, in_flight=2, completed=t))
    s = agg.snapshot(POOL)
    assert (s.serving, s.warm, s.starting, s.draining) == (1, 1, 1, 1)
    assert s.serving_ids == ("w1",) and s.warm_ids == ("w2",)
    assert s.arrival_rate == pytest.approx(5.0 + 1.0 + 1.0)  # completions + queue growth (+ w4's completions)
    assert s.batch_rate == pytest.approx(2.0)
    assert s.batch_in_flight == 3 and s.in_flight == 20
    assert s.waiting == 1  # engines' waiting minus the batch requests (which wait first)
    assert s.slots == 64 and s.kv_usage == pytest.approx(0.8)
    assert s.ttft_p90_s == pytest.approx(0.95, abs=0.05)
    assert s.tpot_p90_s == pytest.approx(0.03, abs=0.005)
    assert s.queue_wait_s == pytest.approx(0.4, abs=0.05)
    # Silent workers are gone after the staleness limit.
    clock.t += 10
    assert agg.snapshot(POOL).serving == 0 and agg.pools() == []


def test_a_worker_restart_does_not_make_negative_rates() -> None:
    clock = Clock(0.0)
    agg = SignalAggregator(clock, rate_window_s=5.0)
    for t in range(5):
        clock.t = float(t)
        agg.on_load(_load("w1", clock.t, completed=100 + 10 * t))
    clock.t = 5.0
    agg.on_load(_load("w1", clock.t, completed=0))
    clock.t = 6.0
    agg.on_load(_load("w1", clock.t, completed=4))
    assert agg.snapshot(POOL).arrival_rate == pytest.approx(4.0)


# ---- the same policy as a fleet-simulator controller -------------------------------------------


@pytest.mark.slow
def test_policy_drives_the_fleet_simulator() -> None:
    import random

    from services.autoscaler.simulated import PolicyController
    from tools.capacity.fleetsim.fast import FastConfig, FastFleet

    rng = random.Random(3)
    arrivals, t = [], 0.0
    while t < 900:  # 4 → 20 req/s over 10 minutes, then back to 4
        rate = 4 + 16 * min(1.0, t / 600) if t < 700 else 4
        t += rng.expovariate(rate)
        arrivals.append((t, 2000, 300, 1000))
    controller = PolicyController(PolicyConfig(cold_start_s=60, warm_start_s=5, scale_down_window_s=120,
                                               down_step_s=10), interval_s=10)
    fleet = FastFleet(FastConfig(replicas=2, cold_start_s=60, warm_start_s=5), arrivals, controller=controller)
    summary = fleet.run()
    assert summary.peak_serving >= 6  # ⌈20 × 1.15 / 4.1⌉ = 6
    assert summary.minute_attainment >= 0.9
    assert any(d.direction == "up" for d in controller.decisions)
    assert any(d.direction == "down" for d in controller.decisions)
    assert controller.decisions[-1].desired_serving < summary.peak_serving


def test_simulator_controller_promotes_warm_replicas_first() -> None:
    from services.autoscaler.policy import Decision
    from services.autoscaler.simulated import PolicyController

    class Node:
        def __init__(self, state: str, warm_target: bool = False) -> None:
            self.state, self.warm_target = state, warm_target

    class Fleet:
        def __init__(self) -> None:
            self.nodes = {f"n{i}": Node(s) for i, s in enumerate(["serving", "serving", "warm", "warm"])}
            self.calls: list[tuple[str, int, bool]] = []

        def promote(self, n: int) -> list[str]:
            self.calls.append(("promote", n, False))
            return [f"p{i}" for i in range(n)]

        def start(self, n: int, *, warm: bool = False) -> list[str]:
            self.calls.append(("start", n, warm))
            return []

        def drain(self, n: int) -> list[str]:
            self.calls.append(("drain", n, False))
            return []

        def stop_warm(self, n: int) -> list[str]:
            self.calls.append(("stop_warm", n, False))
            return []

    def decision(serving: int, warm: int) -> Decision:
        return Decision(pool="sim", at=0.0, direction="up", serving=2, warm=2, starting=0, desired_serving=serving,
                        desired_warm=warm, reason="", causes=(), pressure=0.0, forecast_rate=0.0, capacity_rate=0.0)

    fleet = Fleet()
    PolicyController.apply(decision(5, 2), fleet)
    # 3 more serving: both warm ones promoted, one cold start; the warm pool refilled by cold start.
    assert fleet.calls == [("promote", 2, False), ("start", 1, False), ("start", 2, True)]
    fleet = Fleet()
    PolicyController.apply(decision(1, 1), fleet)
    assert fleet.calls == [("drain", 1, False), ("stop_warm", 1, False)]


# ---- the messages ----------------------------------------------------------------------------


def test_new_load_fields_are_optional_both_ways() -> None:
    import msgspec

    class OldWorkerLoad(msgspec.Struct, kw_only=True, omit_defaults=True):  # as older workers send it
        v: int = 1
        worker_id: str
        model: str
        ts: float
        seq: int
        running: int
        waiting: int
        in_flight: int
        max_running: int
        kv_used_tokens: int
        kv_capacity_tokens: int

    old = msgspec.msgpack.encode(OldWorkerLoad(worker_id="w", model=POOL, ts=1.0, seq=1, running=1, waiting=0,
                                               in_flight=1, max_running=8, kv_used_tokens=0, kv_capacity_tokens=10))
    load = msgspec.msgpack.decode(old, type=m.WorkerLoad)
    assert load.phase == "serving" and load.ttft_hist == [] and load.batch_in_flight == 0
    new = m.encode(_load("w", 1.0, phase="warm", ttft_hist=[1, 2], batch_in_flight=3))
    assert msgspec.msgpack.decode(new, type=OldWorkerLoad).worker_id == "w"  # older readers ignore the rest


def test_scale_decision_round_trips() -> None:
    import msgspec

    message = m.ScaleDecision(pool=POOL, ts=1.0, direction="up", serving=1, warm=0, starting=0, draining=0,
                              desired_serving=3, desired_warm=1, reason="scale up 1→3: …", ttft_p90_s=None,
                              promote=["w2"])
    assert msgspec.msgpack.decode(m.encode(message), type=m.ScaleDecision) == message
    command = msgspec.msgpack.decode(m.encode(m.ControlCommand(action="promote")), type=m.ControlCommand)
    assert command.action == "promote"


def test_simulator_latency_window_weights_the_intervals_by_completions() -> None:
    from types import SimpleNamespace

    from services.autoscaler.simulated import LatencyWindow

    def sig(t: float, completed: int, ttft: float) -> SimpleNamespace:
        return SimpleNamespace(t=t, completed=completed, ttft_p90_s=ttft, tpot_p90_s=float("nan"), queue_wait_p90_s=0.1)

    window = LatencyWindow(30.0)
    assert window.add(sig(5, 300, 0.4)) == (0.4, None, 0.1)
    # One slow 5 s interval with few completions moves the 30 s value a little, not to 2 s.
    ttft, _, _ = window.add(sig(10, 100, 2.0))
    assert ttft == pytest.approx((300 * 0.4 + 100 * 2.0) / 400)
    for t in range(15, 45, 5):
        ttft, _, _ = window.add(sig(t, 300, 0.5))
    assert ttft == pytest.approx(0.5)  # the slow interval has left the window
