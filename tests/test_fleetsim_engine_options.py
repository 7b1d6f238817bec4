"""Speculative decoding and LoRA in the fast fleet simulator: the replica prices its steps with the
same timing-model functions as the planner, checked by hand and against the planner's replica model."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from inferbus.timing import RooflineModel, expected_distinct_adapters
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity.fleetsim.analytic import AnalyticReplica, Req
from tools.capacity.fleetsim.day import constant
from tools.capacity.fleetsim.engine_model import AdapterTraffic, step_model_for
from tools.capacity.fleetsim.fast import FastConfig, FastFleet
from tools.capacity.plan.model import Assumptions, ReplicaModel, Slo, Workload

SPEC = EngineConfig(speculative_num_steps=3, speculative_acceptance=0.7)


def run_one(model, req: Req, chunk: int = 512) -> tuple[AnalyticReplica, float]:  # type: ignore[no-untyped-def]
    finished: list[float] = []
    replica = AnalyticReplica("r", model, kv_capacity=400_000, chunk=chunk, on_finish=lambda r, t: finished.append(t))
    end = replica.add(req, req.arrival)
    while end < math.inf:
        end = replica.segment_end()
    return replica, finished[0]


def test_a_speculative_decode_step_gives_each_sequence_e_tokens():
    model = step_model_for(SPEC)
    e = (1 - 0.7**4) / 0.3  # Leviathan et al.: E = (1 − α^(k+1)) / (1 − α)
    assert model.tokens_per_step == pytest.approx(e)
    replica, finish = run_one(model, Req(0.0, 2000, 11))
    # Ten tokens after the first, each 1/E of an engine step at B = 1 over the growing context.
    steps = [model.step_time(1, 2000 + j, 0, 0.0) / e for j in range(1, 11)]
    req_first = finish - sum(steps)
    assert (finish - req_first) / 10 == pytest.approx(sum(steps) / 10, rel=1e-6)
    # The replica's step prefills 1/E of the engine's chunk; priced as the whole chunk over E.
    assert replica.chunk == round(512 / e)


def test_speculative_prefill_costs_the_engine_chunk_per_token():
    model = step_model_for(SPEC)
    plain = step_model_for(EngineConfig())
    e = model.tokens_per_step
    _, spec_finish = run_one(model, Req(0.0, 2048 * 4, 1), chunk=2048)
    _, plain_finish = run_one(plain, Req(0.0, 2048 * 4, 1), chunk=2048)
    # Four engine chunks of 2,048 tokens as slices of round(2048 / E) = 809: ten whole slices
    # (3.95 engine chunks' worth) and a last one of 102 tokens, priced as its share of an engine
    # step. No decode, so no draft steps: the same prefill within 1%.
    assert round(2048 / e) == 809
    assert spec_finish == pytest.approx(plain_finish, rel=0.01)


def test_lora_steps_pay_for_the_distinct_adapters_in_the_batch():
    model = step_model_for(EngineConfig(max_lora_rank=16), lora_adapters=16)
    assert isinstance(model, AdapterTraffic) and isinstance(model.model, RooflineModel)
    base = model.model
    for batch in (1, 8, 64):
        distinct = expected_distinct_adapters(batch, 16, 8)
        assert model.step_time(batch, 100_000, 0, 0.0) == pytest.approx(
            base.step_time(batch, 100_000, 0, 0.0, distinct)
        )
        assert model.step_time(batch, 100_000, 0, 0.0) > base.step_time(batch, 100_000, 0, 0.0)
    # 16 adapters over 8 slots: a batch of 64 holds all eight slots' worth.
    assert expected_distinct_adapters(64, 16, 8) == 8
    with pytest.raises(ValueError):
        step_model_for(EngineConfig(), lora_adapters=-1)


@pytest.mark.slow
@pytest.mark.parametrize("engine, adapters, tolerance", [
    (EngineConfig(chunked_prefill_size=2048), 0, 0.08),
    (EngineConfig(chunked_prefill_size=2048, speculative_num_steps=3), 0, 0.15),
    (EngineConfig(chunked_prefill_size=2048, max_lora_rank=16), 8, 0.08),
])
def test_the_simulated_fleet_agrees_with_the_planner_with_engine_options(engine, adapters, tolerance):
    mix = mix_mod.load("worked-example", None)
    model = step_model_for(engine, adapters)
    base = model.model if isinstance(model, AdapterTraffic) else model
    planner = ReplicaModel(base, base.kv_capacity_tokens(), Workload.from_mix(mix), Assumptions(chunk_tokens=2048),
                           lora_adapters=adapters, lora_slots=engine.max_loras_per_batch)
    rate = 0.9 * planner.goodput(Slo()).rps
    point = planner.at(rate)
    summary = FastFleet(FastConfig(replicas=4, engine=engine, seed=1), constant(rate * 4, 900, mix, seed=1),
                        step_model=model).run()
    # p90 TPOT: the planner's normal approximation of the chunk-step spread against the simulated
    # requests (the plain engine agrees within a few per cent; speculative decoding prices a
    # prompt's last partial chunk as its share of an engine step, so its spread is wider).
    assert summary.tpot_p90_s == pytest.approx(point.tpot_p90_s, rel=tolerance)
    assert summary.tpot_p90_s <= 0.040


@pytest.mark.slow
def test_simulate_cli_takes_the_engine_options(tmp_path):
    out = tmp_path / "sim"
    args = ["--trace", "azure_2023_conv.csv", "--duration", "30s", "--peak-rps", "20", "--chunk", "2048",
            "--no-progress", "--out", str(out)]
    try:
        from tools.capacity import traces
        traces.find("azure_2023_conv.csv")
    except FileNotFoundError:
        pytest.skip("the Azure conversation trace is not on INFERBUS_TRACES_DIR")
    from tools.commands.simulate import simulate

    plain = CliRunner().invoke(simulate, args)
    spec = CliRunner().invoke(simulate, [*args, "--spec", "3:0.7", "--out", str(out) + "-spec"])
    lora = CliRunner().invoke(simulate, [*args, "--lora-adapters", "16", "--out", str(out) + "-lora"])
    assert plain.exit_code == spec.exit_code == lora.exit_code == 0, (plain.output, spec.output, lora.output)
    import json

    read = {
        name: json.loads((tmp_path / name / "simulate.json").read_text()) for name in ("sim", "sim-spec", "sim-lora")
    }
    # Speculative decoding lifts the goodput the fleet is sized at (fewer replicas), adapters lower it.
    assert (
        read["sim-spec"]["inputs"]["replicas"]
        < read["sim"]["inputs"]["replicas"]
        <= read["sim-lora"]["inputs"]["replicas"]
    )
    assert read["sim-spec"]["inputs"]["spec"] == "3:0.7" and read["sim-lora"]["inputs"]["lora_adapters"] == 16
    bad = CliRunner().invoke(simulate, [*args, "--spec", "3"])
    assert bad.exit_code == 2 and "K:ACCEPTANCE" in bad.output
