"""The canary's pure parts: the sticky split, the SLO gate, the step controller, the eval gate."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from inferbus.releases import canary, eval_gate, slo_gate, split
from proto import messages as m

STABLE, CANDIDATE = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def rollout(share: float = 0.05, **fields: object) -> m.Rollout:
    started = canary.start(STABLE, CANDIDATE, "llama", share, now=0.0, window_s=60.0)
    return m.Rollout(**{**{f: getattr(started, f) for f in started.__struct_fields__}, **fields})  # type: ignore[arg-type]


@pytest.mark.slow
def test_split_share_is_met_and_sticky() -> None:
    small, large = rollout(0.05), rollout(0.25)
    tenants = [f"tenant-{i}" for i in range(20_000)]
    on_small = {t for t in tenants if split.assign(small, t, []) == CANDIDATE}
    on_large = {t for t in tenants if split.assign(large, t, []) == CANDIDATE}
    assert abs(len(on_small) / len(tenants) - 0.05) < 0.006
    assert abs(len(on_large) / len(tenants) - 0.25) < 0.01
    assert on_small <= on_large  # a tenant moved to the candidate stays there as the share grows
    assert all(split.assign(small, t, [1, 2]) == split.assign(small, t, [3]) for t in tenants[:100])


def test_split_by_prefix_and_after_the_canary() -> None:
    by_prefix = rollout(0.5, sticky="prefix")
    sides = {split.assign(by_prefix, "one-tenant", [block, 7]) for block in range(200)}
    assert sides == {STABLE, CANDIDATE}  # conversations of one tenant go both ways
    assert split.assign(by_prefix, "t", []) == split.assign(by_prefix, "t", [])  # no prefix: the tenant
    assert split.assign(None, "t", []) is None
    assert split.assign(canary.rollback(by_prefix, 1.0, "x"), "t", [1]) == STABLE
    promoted = m.Rollout(model="llama", stable=CANDIDATE, state="promoted", candidate=CANDIDATE, share=1.0)
    assert split.assign(promoted, "t", []) == CANDIDATE
    assert split.match_pin(by_prefix, "bbbbbbbb") == CANDIDATE
    assert split.match_pin(by_prefix, "bbbb") is None  # too short to be sure
    assert split.match_pin(by_prefix, "cccccccc") is None


def test_router_places_on_the_assigned_release() -> None:
    from services.router.registry import WorkerView

    views = [WorkerView("a", "llama", 0.0, release=STABLE), WorkerView("b", "llama", 0.0, release=CANDIDATE),
             WorkerView("c", "llama", 0.0)]
    assert [v.worker_id for v in split.workers_of(views, CANDIDATE, pinned=False)] == ["b"]
    other = "sha256:" + "c" * 64
    assert [v.worker_id for v in split.workers_of(views, other, pinned=False)] == ["a", "b", "c"]  # rather than fail
    assert split.workers_of(views, other, pinned=True) == []  # a pin is never served by another release


def window(
    ttft_s: float, tpot_s: float, n: int, rng: random.Random, failed: int = 0, cancelled: int = 0
) -> slo_gate.Window:
    w = slo_gate.Window()
    for _ in range(n):
        m.observe(w.ttft, m.LATENCY_BUCKETS_S, rng.lognormvariate(0, 0.35) * ttft_s)
        m.observe(w.tpot, m.TPOT_BUCKETS_S, rng.lognormvariate(0, 0.15) * tpot_s)
    w.ok, w.failed, w.cancelled = n - failed - cancelled, failed, cancelled
    return w


def test_slo_gate_waits_for_samples() -> None:
    rng = random.Random(1)
    config = slo_gate.SloConfig()
    slow = window(0.6, 0.040, 20, rng, failed=10)
    assert slo_gate.verdict(window(0.3, 0.02, 5000, rng), slow, config).outcome == "wait"


@pytest.mark.slow
def test_slo_gate_passes_equal_and_fails_slower() -> None:
    config = slo_gate.SloConfig()
    outcomes = {"same": [], "slower": [], "errors": []}
    for seed in range(20):
        rng = random.Random(seed)
        base = window(0.3, 0.020, 4000, rng)
        outcomes["same"].append(slo_gate.verdict(base, window(0.3, 0.020, 400, rng), config).outcome)
        outcomes["slower"].append(slo_gate.verdict(base, window(0.3, 0.030, 400, rng), config).outcome)
        outcomes["errors"].append(slo_gate.verdict(base, window(0.3, 0.020, 400, rng, failed=12), config).outcome)
    assert outcomes["same"].count("fail") == 0 and outcomes["same"].count("pass") >= 18
    assert outcomes["slower"] == ["fail"] * 20
    assert outcomes["errors"] == ["fail"] * 20


@pytest.mark.slow
def test_the_mixture_test_keeps_its_level_however_often_it_is_read() -> None:
    # Outcomes at the reference rate itself (the hardest "no worse" case), read after every 10th of
    # 2,000 requests: the mixture test reaches 1/α in at most α of the runs, where a one-look z-test
    # read as often crosses its own α line in many times more of them.
    rng = np.random.default_rng(11)
    alpha, reference, runs, looks = 0.05, 0.1, 1000, range(10, 2001, 10)
    bad = np.cumsum(rng.random((runs, looks[-1])) < reference, axis=1)
    worse = slo_gate.worse_rates(reference)
    crossed = fixed_crossed = 0
    for run in bad:
        crossed += any(slo_gate.log_mixture_ratio(float(run[n - 1]), n, reference, worse) >= math.log(1 / alpha)
                       for n in looks)
        fixed_crossed += any((run[n - 1] / n - reference) / math.sqrt(reference * (1 - reference) / n) > 1.645
                             for n in looks)
    assert crossed / runs <= alpha * 0.8
    assert fixed_crossed / runs >= 4 * alpha
    # Below the reference it is rarer still; well above it, found.
    assert slo_gate.log_mixture_ratio(0, 200, reference, worse) < 0
    assert slo_gate.log_mixture_ratio(40, 200, reference, worse) > math.log(1 / 0.01)


def lognormal_buckets(bounds: tuple[float, ...], median: float, sigma: float) -> list[float]:
    """The probabilities of a histogram's buckets for a lognormal latency."""
    cdf = [0.5 * (1 + math.erf(math.log(b / median) / (sigma * math.sqrt(2)))) for b in bounds] + [1.0]
    return [high - low for low, high in zip([0.0, *cdf[:-1]], cdf)]


def add_requests(window: slo_gate.Window, n: int, ttft: list[float], tpot: list[float], error_rate: float,
                 cancel_rate: float, rng: np.random.Generator) -> None:
    failed, cancelled, ok = rng.multinomial(n, [error_rate, cancel_rate, 1 - error_rate - cancel_rate])
    window.ttft = (np.array(window.ttft) + rng.multinomial(cancelled + ok, ttft)).tolist()
    window.tpot = (np.array(window.tpot) + rng.multinomial(ok, tpot)).tolist()
    window.failed += int(failed)
    window.cancelled += int(cancelled)
    window.ok += int(ok)


@pytest.mark.slow
def test_a_good_candidate_read_every_few_seconds_is_rarely_rolled_back() -> None:
    # The whole gate with no tolerances at all (a good candidate is then exactly at the edge of
    # "no worse" on all four comparisons), both releases failing 1% and cancelling 5% of requests,
    # read after every 50 candidate requests from 200 to 3,000 (57 looks) in 300 steps: at most the
    # bound of rollbacks, with margin. The same looks at a z-test's 99% line, as the gate had, fail
    # several times more of these steps (shown on one comparison above).
    config = slo_gate.SloConfig(latency_tolerance=0.0, ttft_slack_s=0.0, tpot_slack_s=0.0, error_tolerance=0.0,
                                cancel_tolerance=0.0, false_rollback=0.05)
    ttft, tpot = lognormal_buckets(m.LATENCY_BUCKETS_S, 0.3, 0.35), lognormal_buckets(m.TPOT_BUCKETS_S, 0.02, 0.15)
    rng = np.random.default_rng(5)
    runs, rolled_back, passed = 300, 0, 0
    for _ in range(runs):
        base, cand = slo_gate.Window(), slo_gate.Window()
        outcomes = []
        for _look in range(60):
            add_requests(cand, 50, ttft, tpot, 0.01, 0.05, rng)
            add_requests(base, 500, ttft, tpot, 0.01, 0.05, rng)
            outcomes.append(slo_gate.verdict(base, cand, config).outcome)
        rolled_back += "fail" in outcomes
        passed += "pass" in outcomes
    assert rolled_back <= 0.6 * config.false_rollback * runs, rolled_back
    assert passed >= 0.9 * runs  # and the gate does pass them: their share above is 10%, under 15%


def test_a_bad_candidate_is_rolled_back_quickly() -> None:
    # At the defaults, at the level of a canary from 1% (three steps judged): steps 30% slower fail
    # at the first look the gate may take (200 requests); 5% of requests failing, mostly there and
    # always within 400; a version that cannot load at all at the first look (the e2e tests' 40).
    config = slo_gate.SloConfig()
    ttft, tpot = lognormal_buckets(m.LATENCY_BUCKETS_S, 0.3, 0.35), lognormal_buckets(m.TPOT_BUCKETS_S, 0.02, 0.15)
    slow_ttft = lognormal_buckets(m.LATENCY_BUCKETS_S, 0.39, 0.35)
    slow_tpot = lognormal_buckets(m.TPOT_BUCKETS_S, 0.026, 0.15)
    steps = canary.judged_steps(canary.start(STABLE, CANDIDATE, "llama", 0.01, now=0.0))
    assert steps == 3
    rng = np.random.default_rng(9)
    erroring_at: list[int] = []
    for trial in range(50):
        base, slow = slo_gate.Window(), slo_gate.Window()
        add_requests(base, 4000, ttft, tpot, 0.002, 0.02, rng)
        add_requests(slow, 200, slow_ttft, slow_tpot, 0.002, 0.02, rng)
        assert slo_gate.verdict(base, slow, config, steps).outcome == "fail", trial
        erroring = slo_gate.Window()
        add_requests(erroring, 150, ttft, tpot, 0.05, 0.02, rng)
        while (failed := slo_gate.verdict(base, erroring, config, steps)).outcome != "fail":
            assert erroring.requests < 400, (trial, failed.reason)
            add_requests(erroring, 50, ttft, tpot, 0.05, 0.02, rng)
            add_requests(base, 1000, ttft, tpot, 0.002, 0.02, rng)
        assert "error rate" in failed.reason
        erroring_at.append(erroring.requests)
    assert erroring_at.count(200) >= 30, erroring_at
    few = slo_gate.SloConfig(min_samples=40)
    broken = slo_gate.Window(failed=40)
    assert slo_gate.verdict(window(0.3, 0.02, 40, random.Random(2)), broken, few, steps).outcome == "fail"


@pytest.mark.slow
def test_an_erroring_candidate_does_not_pass_on_a_small_sample() -> None:
    # 5% of requests failing against a baseline's 0.2%: at 200 requests a sample may hold too few
    # failures to fail it yet, and then it must wait for more, not pass the step. A good version
    # (the baseline's rates: 0.2% errors, 2% cancels) passes within 400 requests.
    config = slo_gate.SloConfig()
    ttft, tpot = lognormal_buckets(m.LATENCY_BUCKETS_S, 0.3, 0.35), lognormal_buckets(m.TPOT_BUCKETS_S, 0.02, 0.15)
    rng = np.random.default_rng(11)
    base = slo_gate.Window()
    add_requests(base, 4000, ttft, tpot, 0.002, 0.02, rng)
    passed_bad = good_in_time = 0
    for _ in range(200):
        erroring, good = slo_gate.Window(), slo_gate.Window()
        add_requests(erroring, 200, ttft, tpot, 0.05, 0.02, rng)
        while (outcome := slo_gate.verdict(base, erroring, config, 3).outcome) == "wait":
            add_requests(erroring, 50, ttft, tpot, 0.05, 0.02, rng)
        passed_bad += outcome == "pass"
        add_requests(good, 200, ttft, tpot, 0.002, 0.02, rng)
        while (outcome := slo_gate.verdict(base, good, config, 3).outcome) == "wait" and good.requests < 400:
            add_requests(good, 50, ttft, tpot, 0.002, 0.02, rng)
        good_in_time += outcome == "pass"
    assert passed_bad <= 4, passed_bad
    assert good_in_time >= 180, good_in_time


def test_windows_sum_deltas_per_release() -> None:
    windows = slo_gate.Windows()
    def load(seq: int, ok: int, release: str = STABLE, worker: str = "w1") -> m.WorkerLoad:
        return m.WorkerLoad(worker_id=worker, model="llama", ts=seq, seq=seq, running=0, waiting=0, in_flight=0,
                            max_running=8, kv_used_tokens=0, kv_capacity_tokens=1, release=release, finished_ok=ok)
    windows.on_load(load(1, 100))  # a worker's first report is where its counting starts
    windows.on_load(load(2, 130))
    windows.on_load(load(1, 7, CANDIDATE, "w2"))
    windows.on_load(load(2, 9, CANDIDATE, "w2"))
    assert windows.of(STABLE).ok == 30 and windows.of(CANDIDATE).ok == 2
    windows.reset()
    windows.on_load(load(3, 5))  # restarted: its counters went back
    assert windows.of(STABLE).ok == 5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_controller_steps_then_promotes() -> None:
    clock = Clock()
    controller = canary.Controller(clock)
    state = canary.start(STABLE, CANDIDATE, "llama", 0.01, now=0.0, window_s=60.0)
    assert state.steps == [0.01, 0.05, 0.25, 1.0]
    passing = slo_gate.Verdict("pass", "SLO gate passed", {})
    assert controller.decide(state, passing) is None  # inside the window
    shares = []
    for _ in range(3):
        clock.now += 61
        change = controller.decide(state, passing)
        assert change is not None
        state = change.rollout
        shares.append((change.action, state.share))
    assert shares == [("advance", 0.05), ("advance", 0.25), ("promote", 1.0)]
    assert state.state == "promoted" and state.stable == CANDIDATE
    assert controller.decide(state, passing) is None


def test_controller_holds_and_rolls_back() -> None:
    clock = Clock()
    controller = canary.Controller(clock)
    state = canary.start(STABLE, CANDIDATE, "llama", 0.05, now=0.0, window_s=60.0, eval_suite="arithmetic")
    clock.now = 61
    hold = controller.decide(state, slo_gate.Verdict("pass", "ok", {}))
    assert hold is not None and hold.action == "hold" and "eval gate" in hold.reason
    assert controller.decide(state, slo_gate.Verdict("pass", "ok", {})) is None  # the same hold is said once
    failed = controller.decide(state, slo_gate.Verdict("fail", "SLO gate failed: tpot", {}))
    assert failed is not None and failed.action == "rollback" and failed.rollout.share == 0
    assert failed.rollout.state == "rolled_back" and failed.rollout.stable == STABLE
    evaluated = m.Rollout(**{**{f: getattr(state, f) for f in state.__struct_fields__},
                             "eval_verdict": "fail", "eval_reason": "-20 points"})  # type: ignore[arg-type]
    change = controller.decide(evaluated, slo_gate.Verdict("wait", "few", {}))
    assert change is not None and change.action == "rollback" and "-20 points" in change.reason


def test_graders() -> None:
    assert eval_gate.grade({"type": "exact", "expected": "42"}, " 42\n")
    assert not eval_gate.grade({"type": "exact", "expected": "42"}, "42.")
    assert eval_gate.grade({"type": "contains", "expected": "42"}, "it is 42.")
    assert eval_gate.grade({"type": "regex", "pattern": r"-?\d+"}, "-7")
    assert eval_gate.grade({"type": "numeric", "expected": 3.14, "tolerance": 0.01}, "about 3.141")
    assert not eval_gate.grade({"type": "numeric", "expected": 3, "tolerance": 0}, "none")
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    assert eval_gate.grade({"type": "json_schema", "schema": schema}, '{"a": 1}')
    assert not eval_gate.grade({"type": "json_schema", "schema": schema}, '{"a": "x"}')
    with pytest.raises(eval_gate.SuiteError, match="needs 'pattern'"):
        eval_gate.parse_suite('{"prompt": "x", "grader": {"type": "regex"}}', "bad")


def test_shipped_suite_loads() -> None:
    suite = eval_gate.load_suite("arithmetic")
    assert suite.threshold == 0.05 and suite.repeats == 25 and len(suite.items) == 40
    assert {item.grader["type"] for item in suite.items} == set(eval_gate.GRADERS)


def test_eval_verdicts_separate_one_point_from_twenty() -> None:
    # 40 items × 25 repeats per release: the shipped suite's defaults.
    n = 1000
    rng = random.Random(3)
    outcomes = {"fp8": [], "broken": []}
    for _ in range(200):
        base = sum(rng.random() < 0.95 for _ in range(n))
        fp8 = sum(rng.random() < 0.94 for _ in range(n))
        broken = sum(rng.random() < 0.75 for _ in range(n))
        outcomes["fp8"].append(eval_gate.compare(fp8, n, base, n, 0.05).outcome)
        outcomes["broken"].append(eval_gate.compare(broken, n, base, n, 0.05).outcome)
    assert outcomes["broken"].count("fail") == 200
    assert outcomes["fp8"].count("fail") == 0 and outcomes["fp8"].count("pass") >= 185


# ---- an adapter's canary: two versions of one adapter -------------------------------------------

V1, V2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def adapter_spec(candidate: str | None = V2) -> m.AdapterSpec:
    return m.AdapterSpec(name="acme-bot", base_model="llama", version=V1, path="/a/v1", created=0.0, owner="acme",
                         candidate_version=candidate, candidate_path="/a/v2" if candidate else None)


def adapter_rollout(share: float = 0.3, **fields: object) -> m.Rollout:
    started = canary.start(V1, V2, "llama", share, now=0.0, window_s=60.0, sticky="prefix", adapter="acme-bot")
    return m.Rollout(**{**{f: getattr(started, f) for f in started.__struct_fields__}, **fields})  # type: ignore[arg-type]


def test_an_adapters_versions_are_named_and_found_by_engine_name() -> None:
    spec = adapter_spec()
    assert spec.engine_name == "acme-bot@" + "1" * 12 and spec.candidate_engine_name == "acme-bot@" + "2" * 12
    assert spec.version_of(spec.engine_name) == (V1, "/a/v1")
    assert spec.version_of("acme-bot@" + "2" * 12) == (V2, "/a/v2")
    assert spec.version_of("acme-bot@" + "3" * 12) is None
    assert adapter_spec(None).version_of("acme-bot@" + "2" * 12) is None  # no candidate: only the registered one


@pytest.mark.slow
def test_an_adapters_split_is_per_conversation_sticky_and_meets_its_share() -> None:
    spec, rollout = adapter_spec(), adapter_rollout(0.3)
    prompts = [[i, i + 1, i + 2] * 8 for i in range(5_000)]
    keys = [split.adapter_sticky_key(rollout, "acme", ids, 16) for ids in prompts]
    on_candidate = [k for k in keys if split.adapter_version(rollout, spec, k) == V2]
    assert abs(len(on_candidate) / len(keys) - 0.3) < 0.02  # one tenant's conversations go both ways
    # Sticky: the first block decides, whatever follows it (a conversation's later turns).
    first = prompts[0][:16]
    assert split.adapter_sticky_key(rollout, "acme", first + [9, 9, 9], 16) == split.adapter_sticky_key(
        rollout, "x", first, 16
    )
    grown = adapter_rollout(0.6)
    assert all(split.adapter_version(grown, spec, k) == V2 for k in on_candidate)  # stays as the share grows
    by_tenant = adapter_rollout(0.3, sticky="tenant")
    assert len({split.adapter_version(by_tenant, spec, split.adapter_sticky_key(by_tenant, "acme", ids, 16))
                for ids in prompts[:200]}) == 1
    assert split.adapter_in_canary(rollout, spec)


def test_an_adapters_split_after_its_canary_and_when_the_registration_changed() -> None:
    spec = adapter_spec()
    assert split.adapter_version(None, spec, "k") == V1
    rolled = canary.rollback(adapter_rollout(0.5), 1.0, "x")
    assert {split.adapter_version(rolled, spec, f"k{i}") for i in range(50)} == {V1}
    assert not split.adapter_in_canary(rolled, spec)
    promoted = m.Rollout(model="llama", adapter="acme-bot", stable=V2, state="promoted", candidate=V2, share=1.0)
    # Promoted, before or after the registration was settled (V2 the candidate, then the version).
    assert split.adapter_version(promoted, spec, "k") == V2
    settled = m.AdapterSpec(name="acme-bot", base_model="llama", version=V2, path="/a/v2", created=0.0)
    assert split.adapter_version(promoted, settled, "k") == V2
    # Re-registered meanwhile with another version and no candidate: the registration wins.
    other = m.AdapterSpec(name="acme-bot", base_model="llama", version="sha256:" + "3" * 64, path="/a/v3", created=0.0)
    assert split.adapter_version(adapter_rollout(0.99), other, "k") == other.version
    assert split.adapter_version(promoted, other, "k") == other.version
    assert split.match_adapter_pin(spec, "22222222") == V2 and split.match_adapter_pin(spec, "sha256:1111111111") == V1
    assert (
        split.match_adapter_pin(spec, "2222") is None
        and split.match_adapter_pin(adapter_spec(None), "22222222") is None
    )


def adapter_load(worker: str, seq: int, outcomes: dict[str, m.AdapterOutcomes]) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id=worker, model="llama", ts=float(seq), seq=seq, running=0, waiting=0, in_flight=0,
                        max_running=8, kv_used_tokens=0, kv_capacity_tokens=1, adapter_outcomes=outcomes)


def test_adapter_windows_sum_deltas_per_version_and_survive_restarts() -> None:
    from services.worker.release_check import AdapterOutcomes

    tracker = AdapterOutcomes(limit=2)
    windows = slo_gate.AdapterWindows()
    windows.on_load(adapter_load("w1", 1, tracker.load_field()))  # the baseline report
    for _ in range(3):
        tracker.first_token("a@1", 0.2)
        tracker.finished("a@1", "completed", 0.02)
    tracker.first_token("a@2", 0.9)
    tracker.finished("a@2", "failed", None)
    windows.on_load(adapter_load("w1", 2, tracker.load_field()))
    v1, v2 = windows.of("a@1"), windows.of("a@2")
    assert (v1.ok, v1.failed, sum(v1.ttft), sum(v1.tpot)) == (3, 0, 3, 3)
    assert (v2.ok, v2.failed, sum(v2.ttft), sum(v2.tpot)) == (0, 1, 1, 0)
    tracker.finished("a@1", "cancelled", None)
    windows.on_load(adapter_load("w1", 3, tracker.load_field()))
    assert windows.of("a@1").cancelled == 1 and windows.of("a@1").ok == 3  # deltas, not totals again
    # The worker restarted: its counters start over, and all of the new ones count.
    fresh = AdapterOutcomes()
    fresh.finished("a@1", "completed", 0.02)
    windows.on_load(adapter_load("w1", 1, fresh.load_field()))
    assert windows.of("a@1").ok == 4
    windows.reset({"a@1"})
    assert windows.of("a@1").requests == 0 and windows.of("a@2").requests == 1
    # A worker keeps `limit` versions, the least recently used going first.
    tracker.finished("a@3", "completed", None)
    assert set(tracker.load_field()) == {"a@1", "a@3"}


def test_the_controller_keeps_an_adapters_canary_apart_from_its_models() -> None:
    now = [100.0]
    controller = canary.Controller(lambda: now[0])
    wait = slo_gate.Verdict("wait", "too few requests", {})
    model_canary, adapter_canary = rollout(0.05), adapter_rollout(0.3, eval_suite="arithmetic")
    assert controller.decide(model_canary, wait).action == "hold"  # type: ignore[union-attr]
    held = controller.decide(adapter_canary, wait)
    assert held is not None and held.action == "hold"  # its own hold, not silenced by the model's
    assert "--model acme-bot" in held.reason
    failed = controller.decide(msgspec_replace(adapter_canary, eval_verdict="fail", eval_reason="worse"), wait)
    assert failed is not None and failed.action == "rollback" and failed.rollout.adapter == "acme-bot"
    assert failed.rollout.stable == V1 and failed.rollout.share == 0


def msgspec_replace(rollout: m.Rollout, **fields: object) -> m.Rollout:
    import msgspec

    return msgspec.structs.replace(rollout, **fields)


def test_an_adapter_canary_whose_candidate_left_the_registration_is_rolled_back() -> None:
    running = adapter_rollout(0.3)
    assert canary.unregistered_candidate(running, adapter_spec(), 5.0) is None
    replaced = canary.unregistered_candidate(running, adapter_spec(None), 5.0)
    assert replaced is not None and replaced.action == "rollback" and replaced.rollout.share == 0
    assert "registered again" in replaced.reason
    removed = canary.unregistered_candidate(running, None, 5.0)
    assert removed is not None and "was removed" in removed.reason
    assert canary.unregistered_candidate(canary.rollback(running, 1.0, "x"), None, 5.0) is None  # over already
    assert canary.unregistered_candidate(rollout(0.05), None, 5.0) is None  # a model's canary: no registration
