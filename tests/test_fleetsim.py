"""The discrete-event fleet simulator: deterministic, conserving, and running the real policy."""

from __future__ import annotations

import pytest

from inferbus.tokens.blocks import block_hashes
from services.router.placement import Placer
from services.router.policies import LeastLoadedPolicy
from services.router.registry import WorkerRegistry
from services.sim_engine.config import EngineConfig
from tools.capacity.fleetsim import EventLoop, FleetConfig, FleetSim, capacity, workload
from tools.capacity.traces import TraceRequest

BLOCK = 64  # one trace block = one engine block in these tests


def small_engine(**overrides) -> EngineConfig:
    settings = {"gpu": "H100", "tp": 2, "kv_capacity_tokens": 8_192, "max_running_requests": 32}
    settings.update(overrides)
    return EngineConfig(**settings)


def families_trace(n: int = 240, **overrides) -> list[TraceRequest]:
    settings = {"families": 24, "shared_blocks": 12, "unique_blocks": 1, "block_tokens": BLOCK,
                "output_tokens": 12, "rate_rps": 30.0, "seed": 7}
    settings.update(overrides)
    return workload.prefix_families(n, **settings)


def run(trace, policy="affinity", replicas=4, **overrides):
    config = FleetConfig(replicas=replicas, policy=policy, engine=overrides.pop("engine", small_engine()),
                         trace_block_tokens=BLOCK, **overrides)
    sim = FleetSim(config, trace)
    return sim, sim.run()


def outcome(report) -> dict:
    skip = {"cpu_s", "wall_s", "placement_cpu_s", "req_per_cpu_s", "events_per_cpu_s"}
    return {key: value for key, value in report.as_dict().items() if key not in skip}


# ---- the event loop --------------------------------------------------------------------------------


def test_event_loop_runs_in_time_order_with_fifo_ties():
    loop = EventLoop()
    seen = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.after(0.5, lambda: loop.after(1.0, seen.append, "late"))
    assert loop.run(until=1.2) == 3
    assert seen == ["a", "b"] and loop.now == 1.2
    loop.run()
    assert seen == ["a", "b", "late", "c"] and loop.now == 2.0
    assert loop.events_run == 5


# ---- workload ----------------------------------------------------------------------------------------


def test_prompt_tokens_share_exactly_the_shared_blocks():
    prompts = workload.PromptTokens(block_tokens=BLOCK)
    a = prompts.ids(TraceRequest(0.0, 3 * BLOCK, 1, (1, 2, 3)), 0)
    b = prompts.ids(TraceRequest(0.0, 3 * BLOCK - 10, 1, (1, 2, 4)), 1)
    ha, hb = block_hashes(a, BLOCK), block_hashes(b, BLOCK)
    assert len(a) == 3 * BLOCK and len(b) == 3 * BLOCK - 10
    assert ha[:2] == hb[:2] and ha[2] != (block_hashes(b + [0] * 10, BLOCK))[2]
    no_blocks = [prompts.ids(TraceRequest(0.0, 100, 1), i) for i in (5, 6)]
    assert no_blocks[0][:BLOCK] != no_blocks[1][:BLOCK]


def test_at_rate_rescales_to_the_target():
    trace = families_trace(100, rate_rps=5.0)
    fast = workload.at_rate(trace, 50.0)
    assert fast[0].arrival_s == 0.0
    assert (len(fast) - 1) / fast[-1].arrival_s == pytest.approx(50.0)


def test_capacity_estimate_is_the_perf_model_fixed_point():
    trace = families_trace(200)
    engine = small_engine()
    none = capacity.estimate(trace, engine, basis="none")
    ideal = capacity.estimate(trace, engine, basis="ideal", block_tokens=BLOCK)
    assert none.mean_uncached_tokens == none.mean_input_tokens
    assert ideal.mean_uncached_tokens < none.mean_uncached_tokens
    assert ideal.replica_rps > none.replica_rps > 0
    # The definition: a full prefill chunk per step.
    assert none.replica_rps * none.mean_uncached_tokens * none.step_s == pytest.approx(engine.chunked_prefill_size)
    assert capacity.rate_for_load(trace, engine, 4, 0.8) == pytest.approx(0.8 * 4 * none.replica_rps)


# ---- runs ----------------------------------------------------------------------------------------------


def test_same_seed_same_run():
    trace = families_trace(120)
    _, first = run(trace, seed=3)
    _, second = run(trace, seed=3)
    assert outcome(first) == outcome(second)
    assert first.completed == 120


def test_every_request_completes_and_tokens_are_conserved():
    trace = families_trace(200)
    sim, report = run(trace, policy="least_loaded")
    assert (report.completed, report.failed, report.unfinished) == (200, 0, 0)
    assert report.preemptions == 0  # no recomputation, so the sums below are exact
    assert report.prompt_tokens == sum(r.input_tokens for r in trace)
    assert report.prefill_tokens + report.cached_tokens == report.prompt_tokens
    assert report.output_tokens == sum(r.output_tokens for r in trace)
    assert sum(replica.generated_tokens for replica in sim.replicas) == report.output_tokens
    assert sum(replica.processed_tokens for replica in sim.replicas) == report.prefill_tokens + report.output_tokens
    assert all(job.first_token_s is not None and job.first_token_s <= job.finish_s for job in sim.jobs)
    assert report.ttft_p50_s <= report.ttft_p90_s <= report.ttft_p99_s
    assert 0 < report.tpot_p50_s <= report.tpot_p90_s


def test_affinity_beats_round_robin_on_a_prefix_heavy_trace():
    # 24 families × 12 shared blocks = 18k prefix tokens; each replica caches 8k: spraying every
    # family over every replica thrashes, partitioning them fits.
    trace = families_trace(240)
    _, affinity = run(trace, policy="affinity")
    _, round_robin = run(trace, policy="round_robin")
    assert affinity.completed == round_robin.completed == 240
    assert affinity.hit_rate > round_robin.hit_rate + 0.2, (affinity.hit_rate, round_robin.hit_rate)


class _NoCandidates(WorkerRegistry):
    """A registry that never finds an eligible worker (as when every worker drains)."""

    def candidates(self, request):
        return []


def _no_candidates(clock, rng) -> Placer:
    registry = _NoCandidates(clock)
    return Placer(registry, LeastLoadedPolicy(registry, rng))


def test_no_eligible_worker_goes_through_the_shared_queue():
    trace = families_trace(60)
    config = FleetConfig(replicas=4, policy="least_loaded", engine=small_engine(), trace_block_tokens=BLOCK)
    sim = FleetSim(config, trace, placer_factory=_no_candidates)
    report = sim.run()
    assert report.shared_placements == 60
    assert report.completed == 60
    assert sum(1 for replica in sim.replicas if replica.completed) > 1


@pytest.mark.parametrize("recovery", ["shared", "placement"])
def test_a_dead_replica_is_forgotten_and_its_requests_finish_elsewhere(recovery):
    # Slow enough that the victim holds queued and half-generated requests when it dies.
    trace = families_trace(240, output_tokens=40, rate_rps=60.0)
    config = FleetConfig(replicas=4, policy="least_loaded", engine=small_engine(), trace_block_tokens=BLOCK,
                         recovery=recovery)
    sim = FleetSim(config, trace)
    sim.kill_replica("sim-0002", at_s=1.5)
    report = sim.run()
    victim = sim.by_id["sim-0002"]
    assert not victim.alive and victim.recovered
    assert "sim-0002" not in sim.registry.workers
    assert (report.completed, report.failed, report.unfinished) == (240, 0, 0)
    assert report.migrations > 0  # started requests continued elsewhere
    # Clients got every token exactly once across attempts.
    assert all(job.delivered == job.output_tokens for job in sim.jobs)
    migrated = [job for job in sim.jobs if job.attempt > 0]
    assert migrated and all(job.finish_s > victim.died_s for job in migrated)
    # Nothing finished on the victim after it died; nothing was placed there after it was forgotten.
    assert not victim.jobs and not victim.inbox
