"""The batch band in the per-step fleet simulator, driving the production FeedPolicy and
PreemptionPolicy: interactive latency kept, every line done exactly once, resumes lossless."""

from __future__ import annotations

import pytest

from proto import bands
from proto import messages as m
from services.batch.feed import FeedConfig
from services.sim_engine.config import EngineConfig
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine
from tools.capacity.fleetsim import FleetConfig, FleetSim, RunReport, capacity, workload
from tools.capacity.fleetsim.batch import PROMPT_INDEX_BASE, BatchSpec, LineLengths
from tools.capacity.traces import TraceRequest

pytestmark = pytest.mark.slow

ENGINE = EngineConfig()  # H100 TP2, the roofline step time


def interactive(load: float, n: int, replicas: int = 4) -> list[TraceRequest]:
    trace = workload.azure_like(n)
    return workload.at_rate(trace, capacity.rate_for_load(trace, ENGINE, replicas=replicas, load=load))


def run(trace: list[TraceRequest], batch: BatchSpec | None, replicas: int = 4,
        engine: EngineConfig = ENGINE) -> tuple[FleetSim, RunReport]:
    sim = FleetSim(FleetConfig(replicas=replicas, policy="least_loaded", engine=engine), trace, batch=batch)
    return sim, sim.run()


def test_without_a_batch_nothing_changes():
    trace = interactive(0.5, 200)
    plain = FleetSim(FleetConfig(replicas=4, policy="least_loaded", engine=ENGINE), trace).run()
    assert plain.batch is None
    _, again = run(trace, None)
    assert again.ttft_p90_s == plain.ttft_p90_s and again.tpot_p90_s == plain.tpot_p90_s


def test_batch_beside_light_interactive_load_keeps_its_p90_near_the_interactive_only_run():
    trace = interactive(0.4, 900)
    _, alone = run(trace, None)
    sim, both = run(trace, BatchSpec(lines=2_000, stop_with_interactive=True))
    assert both.completed == alone.completed == len(trace)
    # The promise is 10 % (measured at fleet scale by bench/batch.py); on 4 replicas the shipped
    # settings land at +1 to +18 % depending on the seed, so the test bounds it at 20 %...
    assert both.ttft_p90_s <= 1.20 * alone.ttft_p90_s
    assert both.tpot_p90_s <= 1.20 * alone.tpot_p90_s
    # ...while the batch did real work: over 150 output tokens/s per replica on average.
    assert both.batch.output_tokens / both.makespan_s > 150 * 4
    # The feed policy worked from the load reports: it saw spare capacity in them.
    assert both.batch.reports_seen > 0
    assert any(state.spare > 0 for _, state in sim.band.feed_states)
    # Without the policies, the same batch at 16 lines per replica costs interactive more.
    _, greedy = run(trace, BatchSpec(lines=2_000, stop_with_interactive=True, fixed_concurrency=16))
    assert greedy.tpot_p90_s > 1.20 * alone.tpot_p90_s


def test_load_reports_carry_interactive_histograms_and_batch_in_flight():
    trace = interactive(0.4, 300)
    sim = FleetSim(FleetConfig(replicas=2, policy="least_loaded", engine=ENGINE), trace,
                   batch=BatchSpec(lines=300, stop_with_interactive=True))
    seen: list[m.WorkerLoad] = []
    observe = sim.band.observe
    sim.band.observe = lambda load: (seen.append(load), observe(load))  # type: ignore[method-assign]
    sim.run()
    last = {load.worker_id: load for load in seen}
    # Every interactive request counted once in TTFT and queue wait, no batch line in them.
    assert sum(sum(load.ttft_hist) for load in last.values()) <= len(trace)
    assert sum(sum(load.ttft_hist) for load in last.values()) >= 0.9 * len(trace)
    assert all(len(load.tpot_fine_hist) == len(m.TPOT_BUCKETS_S) + 1 for load in last.values())
    assert any(load.batch_in_flight > 0 for load in seen)
    assert all(load.in_flight >= load.batch_in_flight for load in seen)
    # Lines that ended before a worker's last report are in its count; later ones may not be yet.
    reported = sum(load.completed_batch for load in last.values())
    completed = [line for line in sim.band.lines if line.status == "completed"]
    before_last = min(load.ts for load in last.values())
    assert sum(line.finish_s <= before_last for line in completed) <= reported <= len(completed)
    assert reported > 0
    # batch_waiting: the batch lines without a first token, never more than the batch lines held.
    assert all(0 <= load.batch_waiting <= load.batch_in_flight for load in seen)
    assert any(load.batch_waiting > 0 for load in seen)


def uninterrupted(spec: BatchSpec, sim: FleetSim) -> list[list[int]]:
    """Each line's output when it runs once, start to finish, on an idle engine."""
    engine = Engine(EngineConfig(kv_capacity_tokens=200_000))
    requests = []
    for line in sim.band.lines:
        trace = TraceRequest(0.0, line.input_tokens, line.output_tokens)
        prompt = sim.prompts.ids(trace, PROMPT_INDEX_BASE + line.line)
        request = Request(rid=f"alone-{line.line}", input_ids=prompt, priority=bands.ENGINE_PRIORITY["batch"],
                          sampling=SamplingParams(max_new_tokens=line.output_tokens, temperature=0.0, ignore_eos=True))
        engine.add(request)
        requests.append(request)
    while engine.has_work:
        engine.step()
    return [request.output_ids for request in requests]


def test_every_line_completes_exactly_once_and_preempted_lines_resume_with_their_tokens():
    # Small engines (8 slots) and bursts of interactive work: the workers preempt batch lines.
    engine = EngineConfig(max_running_requests=8, kv_capacity_tokens=12_000)
    bursts = [TraceRequest(2.0 + 3.0 * burst + 0.01 * i, 700, 40) for burst in range(8) for i in range(24)]
    spec = BatchSpec(lines=120, record_output=True,
                     lengths=LineLengths(input_median=300, input_p90=900, output_median=120, output_p90=300,
                                         output_max=400))
    sim, report = run(bursts, spec, replicas=2, engine=engine)
    lines = sim.band.lines
    assert report.completed == len(bursts)
    assert report.batch.completed == len(lines) and report.batch.failed == 0 and report.batch.unfinished == 0
    assert all(line.results == 1 for line in lines)
    assert report.batch.preemptions > 0 and report.batch.preempted_lines > 0
    expected = uninterrupted(spec, sim)
    for line, want in zip(lines, expected):
        assert len(line.output) == line.output_tokens
        assert line.output == want, f"line {line.line} (preempted {line.preempted}×) lost or repeated tokens"
    # Every token generated counted once: resumes re-prefill, they do not regenerate.
    assert report.batch.output_tokens == sum(line.output_tokens for line in lines)


def test_no_batch_is_fed_while_interactive_saturates_the_fleet():
    trace = interactive(1.3, 600)  # arrivals at 130 % of what the fleet serves, for ~18 s
    _, alone = run(trace, None)
    sim, report = run(trace, BatchSpec(lines=500, stop_with_interactive=True))
    start, end = 2.0, trace[-1].arrival_s  # the feed's first tick sees an idle fleet; then it fills up
    published = [line for line in sim.band.lines if line.published_s is not None]
    assert published and not any(start <= line.published_s <= end for line in published)
    batch_tokens, _ = sim.band.tokens_between(start, end)
    interactive_tokens = sum(job.output_tokens for job in sim.jobs if start <= job.arrival_s < end)
    assert batch_tokens < 0.02 * interactive_tokens
    assert report.completed == alone.completed == len(trace)


def test_a_replica_dying_mid_batch_loses_and_repeats_nothing():
    trace = interactive(0.3, 200, replicas=3)
    # Feeding from the start (no baseline learning), so the replica holds batch lines at 4 s.
    spec = BatchSpec(lines=80, record_output=True, feed_config=FeedConfig(baseline_wait_s=0),
                     lengths=LineLengths(input_median=300, input_p90=900, output_median=200, output_p90=400,
                                         output_max=600))
    sim = FleetSim(FleetConfig(replicas=3, policy="least_loaded", engine=ENGINE), trace, batch=spec)
    sim.kill_replica("sim-0002", at_s=4.0)
    report = sim.run()
    assert report.completed == len(trace)
    assert report.batch.requeued_dead > 0  # it held batch lines when it died
    assert all(line.results == 1 and line.status == "completed" for line in sim.band.lines)
    for line, want in zip(sim.band.lines, uninterrupted(spec, sim)):
        assert line.output == want
