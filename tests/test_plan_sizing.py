"""The rule every fleet is sized by (tools/capacity/plan/sizing.py): the headroom in a large fleet,
one replica beyond the busiest minute's need in a small one."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from tools.capacity import mix as mix_mod
from tools.capacity.plan.model import Slo, Workload
from tools.capacity.plan.planner import PlanInputs, make_plan
from tools.capacity.plan.sizing import FleetTerms
from tools.commands.plan import plan as plan_command


def test_a_large_fleet_is_sized_by_the_headroom() -> None:
    terms = FleetTerms(rate_rps=833.33, headroom=0.15, zone_factor=1.0)
    sized = terms.replicas(3.071)
    # 271.4 needed: × 1.15 = 312.07 → 313; the spare term, 271.4 × 1.1 × 1.025 + 1, is 307.
    assert (sized.count, sized.binding) == (313, "headroom")
    assert sized.by_headroom == pytest.approx(312.07, abs=0.02)
    assert math.ceil(sized.by_spare) + 1 == 307


def test_a_small_pool_keeps_one_replica_beyond_the_busiest_minute() -> None:
    # A decode pool whose replica holds 10.36 req/s at a 20 req/s peak needs 1.93: the headroom
    # gives ⌈2.22⌉ = 3, and one of three down leaves 2 × 10.36 for the busiest minute's 22.6 (with
    # the model's error): too few. The spare term gives ⌈2.18⌉ + 1 = 4.
    sized = FleetTerms(rate_rps=20.0, headroom=0.15, zone_factor=1.0).replicas(10.36)
    assert (sized.count, sized.binding) == (4, "N+1")
    assert (sized.count - 1) * 10.36 >= 20.0 * 1.1 * 1.025


def test_a_whole_need_is_not_rounded_up_by_float_noise() -> None:
    # 1.0 × 1.1 × 1.025 = 1.1275 needed with one down → 2 + 1; with no forecast or model error, exactly
    # 2 needed with one down → 3, not 4.
    assert FleetTerms(rate_rps=1.0, headroom=0.0, zone_factor=1.0).replicas(1.0).count == 3
    exact = FleetTerms(rate_rps=0.3, headroom=0.0, zone_factor=1.0, forecast_error=0.0, model_error=0.0)
    assert exact.replicas(0.1).count == 4


def test_the_zone_factor_stays_on_the_headroom_term() -> None:
    sized = FleetTerms(rate_rps=100.0, headroom=0.15, zone_factor=1.5).replicas(1.0)
    assert (sized.count, sized.binding) == (173, "headroom")


def test_the_forecast_error_reaches_the_plan_and_its_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    workload = Workload.from_mix(mix_mod.worked_example())

    def replicas(error: float) -> int:
        inputs = PlanInputs(rate_rps=6.0, rate_text="", workload=workload, mix={}, slo=Slo(),
                            gpu_prices={"H100": 2.5}, tps=[2], forecast_error=error, disaggregation=False)
        row = make_plan(inputs).rows[0]
        assert row.sizing is not None and row.sizing.count == row.replicas
        return row.replicas

    # H100 TP2 holds 3.07 req/s: 1.95 needed; 10%: ⌈2.20⌉ + 1 = 4; 60%: ⌈3.20⌉ + 1 = 5.
    assert (replicas(0.1), replicas(0.6)) == (4, 5)
    result = CliRunner().invoke(plan_command, ["--rps", "6", "--tp", "2", "--gpu", "H100:2.5", "--no-compare",
                                               "--no-disagg", "--forecast-error", "0.6", "--out", str(tmp_path),
                                               "--no-plots"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "plan.md").read_text()
    assert "⌈6.00 ÷ 3.071 × 1.6 × 1.025⌉ + 1) = max(⌈2.25⌉, ⌈3.20⌉ + 1) = 5 **serving**" in text
    assert "it binds in a fleet of a few replicas, as here" in text
    row = json.loads((tmp_path / "plan.json").read_text())["rows"][0]
    assert (row["replicas"], row["replicas_set_by"]) == (5, "N+1")
    assert row["replicas_spare_exact"] == pytest.approx(6 / 3.071 * 1.6 * 1.025, rel=1e-3)
    refused = CliRunner().invoke(plan_command, ["--rps", "6", "--forecast-error", "-0.1"])
    assert refused.exit_code == 2 and "--forecast-error" in refused.output
