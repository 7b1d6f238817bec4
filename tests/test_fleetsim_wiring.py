"""The production hooks wired once (`inferbus.capacity.fleetsim.wiring`): one run of the per-step
simulator combines autoscaling with a batch band, or admission with prefix affinity."""

from __future__ import annotations

from inferbus.capacity.fleetsim import FleetConfig, FleetSim, capacity, workload
from inferbus.capacity.fleetsim.batch import BatchSpec
from inferbus.capacity.fleetsim.wiring import fleet_states
from services.autoscaler.policy import PolicyConfig
from services.autoscaler.simulated import PolicyController
from services.sim_engine.config import EngineConfig

BLOCK = 64


def test_one_run_autoscales_a_fleet_that_also_serves_a_batch_band():
    engine = EngineConfig()
    trace = workload.azure_like(600)
    rate = capacity.rate_for_load(trace, engine, replicas=3, load=0.8)
    trace = workload.at_rate(trace, rate)
    # A replica is worth a third of the offered rate: the autoscaler wants more than the one it has.
    controller = PolicyController(PolicyConfig(goodput_rps=rate / 3, cold_start_s=5.0, warm_start_s=1.0, max_serving=4,
                                               max_replicas=6, slo_cooldown_s=2.0), interval_s=1.0)
    config = FleetConfig(replicas=1, policy="least_loaded", engine=engine, cold_start_s=5.0, warm_start_s=1.0)
    sim = FleetSim(config, trace, batch=BatchSpec(lines=200), controller=controller)
    report = sim.run()
    assert (report.completed, report.failed, report.unfinished) == (600, 0, 0)
    assert report.batch is not None and report.batch.completed == 200
    # The controller started replicas, and those served both bands.
    assert controller.decisions[0].desired_serving > 1
    started = [replica for replica in sim.replicas if replica.worker_id != "sim-0001"]
    assert started and all(replica.started_s >= config.cold_start_s for replica in started)
    assert any(replica.completed > 0 and replica.completed_batch > 0 for replica in started)
    assert fleet_states(sim.nodes.values())["serving"] == len(sim.replicas)


def test_a_drained_replica_finishes_its_work_and_stops():
    engine = EngineConfig()
    trace = workload.at_rate(workload.azure_like(200), 8.0)
    sim = FleetSim(FleetConfig(replicas=3, policy="least_loaded", engine=engine), trace)
    sim.loop.at(5.0, sim.drain, 1, ["sim-0002"])
    report = sim.run()
    assert (report.completed, report.failed, report.unfinished) == (200, 0, 0)
    drained = sim.by_id["sim-0002"]
    assert drained.state == "stopped" and drained.stopped_s is not None and "sim-0002" not in sim.nodes
    assert "sim-0002" not in sim.registry.workers
    assert all(job.finish_s is not None and job.finish_s > 0 for job in sim.jobs)
    # Nothing was placed on it once the router heard it drain.
    assert drained.completed < min(sim.by_id[w].completed for w in ("sim-0001", "sim-0003"))


def families(rate_rps: float) -> list:
    return workload.prefix_families(600, families=24, shared_blocks=12, unique_blocks=1, block_tokens=BLOCK,
                                    output_tokens=12, rate_rps=rate_rps, seed=7)


def run(trace: list, policy: str, admission: bool):
    engine = EngineConfig(gpu="H100", tp=2, kv_capacity_tokens=8_192, max_running_requests=32)
    config = FleetConfig(replicas=2, policy=policy, engine=engine, trace_block_tokens=BLOCK, admission=admission,
                         admission_budget_s=0.5)
    return FleetSim(config, trace).run()


def test_one_run_sheds_overload_while_placing_by_prefix_affinity():
    trace = families(200.0)  # several times what two replicas serve
    flooded = run(trace, "affinity", admission=False)
    shed = run(trace, "affinity", admission=True)
    assert shed.rejected > 0 and shed.completed + shed.rejected == len(trace) and shed.unfinished == 0
    assert shed.ttft_p90_s < flooded.ttft_p90_s / 2  # what is admitted is served in time
    # The admitted requests still go where their prefix is: more hits than round robin's.
    assert shed.hit_rate > run(trace, "round_robin", admission=True).hit_rate + 0.1


def test_admission_sheds_nothing_below_capacity():
    trace = families(30.0)
    on, off = run(trace, "affinity", admission=True), run(trace, "affinity", admission=False)
    assert on.rejected == 0 and on.completed == len(trace)
    assert (on.hit_rate, on.ttft_p90_s, on.tpot_p90_s) == (off.hit_rate, off.ttft_p90_s, off.tpot_p90_s)
