"""bench/routing_bound.py: the clairvoyant placement and the no-queue floor it is compared with."""

from __future__ import annotations

from bench.routing_bound import ClairvoyantFleet, alone, first_token_at
from services.sim_engine.config import EngineConfig
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine
from tools.capacity.fleetsim import FleetConfig, FleetSim
from tools.capacity.traces import TraceRequest


def engine_config() -> EngineConfig:
    return EngineConfig(gpu="H100", tp=2, mixed_chunk=False)


def test_the_copy_finds_the_first_token_the_engine_itself_gives_and_leaves_the_engine_alone() -> None:
    engine = Engine(engine_config())
    busy = Request(rid="busy", input_ids=list(range(6000)),
                   sampling=SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True))
    engine.add(busy)
    engine.step()  # a step of the busy request in progress: its clock is at the step's end
    before = (engine.now, len(engine.waiting), len(engine.running))
    predicted = first_token_at(engine, 0.0, True, list(range(10_000, 13_000)), 8)
    assert (engine.now, len(engine.waiting), len(engine.running)) == before

    probe = Request(rid="real", input_ids=list(range(10_000, 13_000)),
                    sampling=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add(probe)
    while True:
        result = engine.step()
        if any(u.request is probe and u.num_output_tokens > 0 for u in result.updates):
            break
    assert predicted == engine.now
    # Behind a 6,000-token prompt in 512-token chunks, later than on an idle engine.
    assert predicted > first_token_at(Engine(engine_config()), 0.0, False, list(range(10_000, 13_000)), 8)


def test_clairvoyant_placement_sends_a_request_to_the_idle_replica_not_behind_a_long_prompt() -> None:
    trace = [TraceRequest(0.0, 30_000, 20), TraceRequest(0.01, 2_000, 20), TraceRequest(0.02, 2_000, 20)]
    sim = ClairvoyantFleet(FleetConfig(replicas=2, engine=engine_config()), trace)
    report = sim.run()
    assert report.completed == 3
    placed = {r.worker_id: r.engine.prompt_tokens_total for r in sim.replicas}
    # The long prompt alone on one replica, both short ones on the other.
    assert sorted(placed.values()) == [4_000, 30_000]
    # Round-robin puts the third behind the long prompt: its first token comes much later.
    rr = FleetSim(FleetConfig(replicas=2, policy="round_robin", engine=engine_config()), trace).run()
    assert report.ttft_p99_s < rr.ttft_p99_s


def test_alone_takes_off_what_an_infinite_cache_holds_and_keeps_the_last_token() -> None:
    trace = [
        TraceRequest(0.0, 1024, 5, (1, 2)),
        TraceRequest(1.0, 1500, 5, (1, 2, 3)),
        TraceRequest(2.0, 1024, 5, (1, 2)),
    ]
    out = alone(trace)
    assert [r.input_tokens for r in out] == [1024, 1500 - 1024, 1]
    assert all(r.hash_ids == () for r in out) and [r.arrival_s for r in out] == [0.0, 1.0, 2.0]


def test_the_report_names_the_load_and_puts_each_p90_over_affinitys() -> None:
    from bench.routing_bound import markdown

    rows = [{"placement": name, "hit_rate": 0.04, "ttft_p50_s": 1.0, "ttft_p90_s": p90, "ttft_p99_s": 9.0,
             "tpot_p90_s": 0.08, "cpu_s": 1.0} for name, p90 in (("affinity", 4.0), ("clairvoyant", 3.8))]
    text = markdown({"date": "now", "command": "python -m bench.routing_bound", "replicas": 4, "gpu": "H100", "tp": 2,
                     "trace": "t.jsonl", "workload": {"requests": 250, "target_load": 0.8, "ceiling_hit_rate": 0.064},
                     "rows": rows})
    assert "load 80% at perfect-affinity hits" in text and "ceiling 6.4%" in text
    assert "| clairvoyant | 4.0% | 1.00 / 3.80 / 9.00 | 0.95 | 80.0 | 1.0 |" in text
