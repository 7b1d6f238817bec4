"""The canary's pure parts: the sticky split, the SLO gate, the step controller, the eval gate."""

from __future__ import annotations

import random

import pytest

from inferbus.releases import canary, eval_gate, slo_gate, split
from proto import messages as m

STABLE, CANDIDATE = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def rollout(share: float = 0.05, **fields: object) -> m.Rollout:
    started = canary.start(STABLE, CANDIDATE, "llama", share, now=0.0, window_s=60.0)
    return m.Rollout(**{**{f: getattr(started, f) for f in started.__struct_fields__}, **fields})  # type: ignore[arg-type]


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


def window(ttft_s: float, tpot_s: float, n: int, rng: random.Random, failed: int = 0, cancelled: int = 0) -> slo_gate.Window:
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
