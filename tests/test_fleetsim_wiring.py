"""The production hooks wired once (`tools.capacity.fleetsim.wiring`): one run of the per-step
simulator combines autoscaling with a batch band, or admission with prefix affinity."""

from __future__ import annotations

import pytest

from services.autoscaler.policy import PolicyConfig
from services.autoscaler.simulated import PolicyController
from services.sim_engine.config import EngineConfig
from tools.capacity.fleetsim import FleetConfig, FleetSim, capacity, workload
from tools.capacity.fleetsim.batch import BatchSpec
from tools.capacity.fleetsim.wiring import Lifecycle, fleet_states

BLOCK = 64


@pytest.mark.slow
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


@pytest.mark.slow
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


class Node:
    def __init__(self, name: str, in_flight: int = 0) -> None:
        self.name, self.in_flight, self.state, self.warm_target = name, in_flight, "starting", False


class Loop:
    """A loop's side of `Lifecycle`: a timer list instead of a clock, and a log of what it was asked."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.timers: list[tuple[float, Node]] = []
        self.log: list[tuple[str, str]] = []
        self.lifecycle = Lifecycle(self.nodes, cold_start_s=120.0, warm_start_s=5.0, new_replica=self.new_replica,
                                   after=lambda delay, node: self.timers.append((delay, node)), serve=self.serve,
                                   begin_drain=self.begin_drain, park=lambda node: self.log.append(("park", node.name)),
                                   stop=self.stop)

    def new_replica(self) -> Node:
        node = self.nodes[f"r{len(self.nodes)}"] = Node(f"r{len(self.nodes)}")
        return node

    def serve(self, node: Node) -> None:
        node.state = "serving"

    def begin_drain(self, node: Node) -> None:
        self.log.append(("drain", node.name))
        if node.in_flight == 0:
            self.lifecycle.drained(node)

    def stop(self, node: Node) -> None:
        node.state = "stopped"
        del self.nodes[node.name]

    def fire(self) -> list[float]:
        delays = [delay for delay, _ in self.timers]
        for _, node in self.timers:
            self.lifecycle.ready(node)
        self.timers.clear()
        return delays


def test_lifecycle_moves_replicas_between_states_the_same_way_for_both_loops():
    loop = Loop()
    life = loop.lifecycle
    assert life.start(2) == ["r0", "r1"] and life.start(1, warm=True) == ["r2"]
    assert loop.fire() == [120.0, 120.0, 120.0]
    assert [n.state for n in loop.nodes.values()] == ["serving", "serving", "warm"]
    assert life.promote(5) == ["r2"] and loop.nodes["r2"].state == "starting" and loop.fire() == [5.0]
    assert loop.nodes["r2"].state == "serving"
    # Drain picks the least busy; one with work left waits for `drained`, an empty one goes at once.
    loop.nodes["r0"].in_flight, loop.nodes["r1"].in_flight, loop.nodes["r2"].in_flight = 3, 0, 1
    assert life.drain(2, to_warm=True) == ["r1", "r2"]
    assert loop.nodes["r1"].state == "warm" and loop.nodes["r2"].state == "draining"
    assert ("park", "r1") in loop.log and ("park", "r2") not in loop.log
    life.drained(loop.nodes["r2"])
    assert loop.nodes["r2"].state == "warm" and not loop.nodes["r2"].warm_target
    assert life.drain(ids=["r0", "r1"]) == ["r0"]  # r1 is warm, not serving
    life.drained(loop.nodes["r0"])
    assert "r0" not in loop.nodes
    assert life.stop_warm(ids=["r2"]) == ["r2"] and list(loop.nodes) == ["r1"]
    # A timer of a replica no longer starting (stopped meanwhile) changes nothing.
    stale = Node("gone")
    stale.state = "stopped"
    life.ready(stale)
    assert stale.state == "stopped"
    assert fleet_states(loop.nodes.values()) == {"starting": 0, "warm": 1, "serving": 0, "draining": 0}


@pytest.mark.slow
def test_the_per_step_fleet_parks_a_drained_replica_warm_and_promotes_it_again():
    engine = EngineConfig()
    trace = workload.at_rate(workload.azure_like(400), 8.0)  # arrivals for ~50 s
    sim = FleetSim(FleetConfig(replicas=2, policy="least_loaded", engine=engine, warm_start_s=2.0), trace)
    sim.loop.at(3.0, lambda: sim.drain(ids=["sim-0002"], to_warm=True))
    sim.loop.at(30.0, sim.promote, 1)
    seen: dict[float, tuple[str, int]] = {}
    for t in (29.0, 31.0, 33.0):
        sim.loop.at(t, lambda t=t: seen.update({t: (sim.by_id["sim-0002"].state, sim.by_id["sim-0002"].completed)}))
    report = sim.run()
    replica = sim.by_id["sim-0002"]
    assert (report.completed, report.failed, report.unfinished) == (400, 0, 0)
    assert [state for state, _ in seen.values()] == ["warm", "starting", "serving"]
    assert seen[29.0][1] == seen[31.0][1] < replica.completed  # idle while warm and starting, serving again after
    assert replica.epoch == 2 and "sim-0002" in sim.nodes


def families(rate_rps: float) -> list:
    return workload.prefix_families(600, families=24, shared_blocks=12, unique_blocks=1, block_tokens=BLOCK,
                                    output_tokens=12, rate_rps=rate_rps, seed=7)


def run(trace: list, policy: str, admission: bool):
    engine = EngineConfig(gpu="H100", tp=2, kv_capacity_tokens=8_192, max_running_requests=32)
    config = FleetConfig(replicas=2, policy=policy, engine=engine, trace_block_tokens=BLOCK, admission=admission,
                         admission_budget_s=0.5)
    return FleetSim(config, trace).run()


@pytest.mark.slow
def test_one_run_sheds_overload_while_placing_by_prefix_affinity():
    trace = families(200.0)  # several times what two replicas serve
    flooded = run(trace, "affinity", admission=False)
    shed = run(trace, "affinity", admission=True)
    assert shed.rejected > 0 and shed.completed + shed.rejected == len(trace) and shed.unfinished == 0
    assert shed.ttft_p90_s < flooded.ttft_p90_s / 2  # what is admitted is served in time
    # The admitted requests still go where their prefix is: more hits than round robin's.
    assert shed.hit_rate > run(trace, "round_robin", admission=True).hit_rate + 0.1


@pytest.mark.slow
def test_admission_sheds_nothing_below_capacity():
    trace = families(30.0)
    on, off = run(trace, "affinity", admission=True), run(trace, "affinity", admission=False)
    assert on.rejected == 0 and on.completed == len(trace)
    assert (on.hit_rate, on.ttft_p90_s, on.tpot_p90_s) == (off.hit_rate, off.ttft_p90_s, off.tpot_p90_s)
