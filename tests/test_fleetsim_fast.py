"""The fast fleet simulator: its analytic replica against the engine's timing model, its fleet
against the per-step simulator, the policy fast path against the policy's own choice, and the CLI."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
from click.testing import CliRunner

from inferbus.timing import roofline
from proto import messages as m
from services.router.placement import make_placer
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity.fleetsim import FleetConfig, FleetSim, capacity, workload
from tools.capacity.fleetsim.analytic import AnalyticReplica, Req, step_function
from tools.capacity.fleetsim.day import DayWorkload, constant, diurnal, parse_duration, rate_shape
from tools.capacity.fleetsim.fast import FastConfig, FastFleet, FleetSignals
from tools.capacity.fleetsim.sampler import LoadSampler

MODEL = roofline("H100", 2, "latency")


def replica(kv: int = 400_000, chunk: int = 512, max_running: int = 256) -> tuple[AnalyticReplica, list[Req]]:
    done: list[Req] = []
    rep = AnalyticReplica("r", MODEL, kv_capacity=kv, chunk=chunk, max_running=max_running,
                          on_finish=lambda req, t: done.append(req))
    return rep, done


def run_replica(rep: AnalyticReplica, arrivals: list[Req]) -> None:
    """Drive one replica as the fleet does: arrivals and segment ends in time order."""
    pending = sorted(arrivals, key=lambda r: r.arrival)
    end = math.inf
    while pending or end < math.inf:
        if pending and pending[0].arrival <= end:
            req = pending.pop(0)
            end = rep.add(req, req.arrival)
        else:
            end = rep.segment_end()


# ---- the analytic replica ------------------------------------------------------------------------


def test_roofline_step_function_is_the_model():
    rng = random.Random(1)
    fn = step_function(MODEL)
    for _ in range(500):
        args = (
            rng.randrange(0, 300),
            rng.randrange(0, 400_000),
            rng.choice([0, rng.randrange(1, 4096)]),
            rng.random() * 8000,
        )
        assert fn(*args) == pytest.approx(MODEL.step_time(*args), rel=1e-12)


def test_single_request_ttft_is_its_chunked_prefill_time():
    rep, done = replica()
    req = Req(1.0, 1200, 1)
    run_replica(rep, [req])
    # Chunks of 512, 512, 176 tokens, each attending to its start plus half its size.
    expected = sum(MODEL.step_time(0, 0, n, c) for n, c in ((512, 256), (512, 768), (176, 1024 + 88)))
    assert done == [req]
    assert req.first - req.arrival == pytest.approx(expected, rel=1e-9)


def test_single_request_tpot_is_the_batch_of_one_step_time():
    finish: list[float] = []
    rep = AnalyticReplica("r", MODEL, kv_capacity=400_000, on_finish=lambda r, t: finish.append(t))
    req = Req(0.0, 2000, 11)
    run_replica(rep, [req])
    # Ten decode steps at B = 1 over a context growing from 2001 to 2010 tokens.
    steps = [MODEL.step_time(1, 2000 + j, 0, 0.0) for j in range(1, 11)]
    assert (finish[0] - req.first) / 10 == pytest.approx(sum(steps) / 10, rel=1e-6)
    assert req.first == pytest.approx(sum(MODEL.step_time(0, 0, n, c) for n, c in ((512, 256), (512, 768),
                                                                                   (512, 1280), (464, 1536 + 232))))


def test_cached_tokens_skip_prefill():
    cold, _ = replica()
    warm, _ = replica()
    a, b = Req(0.0, 4096, 1), Req(0.0, 4096, 1, cached_tokens=3584)
    run_replica(cold, [a])
    run_replica(warm, [b])
    assert b.first < a.first / 4
    assert warm.prefilled_tokens == 512 and cold.prefilled_tokens == 4096


def test_request_waits_for_kv_then_runs():
    rep, done = replica(kv=6_000)
    first, second = Req(0.0, 3000, 50), Req(0.001, 3000, 5)
    run_replica(rep, [first, second])
    assert [r is first for r in done] == [True, False]
    # The second could not be admitted while the first held the KV: its prefill starts after.
    assert second.start >= first.first
    assert second.first > first.first


def test_arrival_mid_segment_joins_at_the_next_step_boundary():
    rep, done = replica()
    long = Req(0.0, 100, 200)
    late = Req(0.5, 100, 2)
    run_replica(rep, [long, late])
    decode = MODEL.step_time(1, 150, 0, 0.0)
    # It starts at the first step boundary after it arrived: less than one decode step later.
    assert 0.5 <= late.start < 0.5 + 1.05 * decode
    assert done[0] is late and done[1] is long


def test_prefill_is_fifo_and_batches_short_prompts_into_one_step():
    rep, done = replica()
    reqs = [Req(0.0, 100, 1) for _ in range(4)]
    run_replica(rep, reqs)
    assert len({r.first for r in reqs}) == 1  # 400 tokens: one partial chunk finishes them all
    assert reqs[0].first == pytest.approx(MODEL.step_time(0, 0, 400, 50), rel=1e-9)
    assert rep.D == 1


def test_unmixed_steps_do_not_decode_while_prefilling():
    """Without mixed steps (SGLang's default) a running sequence waits out another's prefill."""
    finish: dict[str, float] = {}
    for mixed in (True, False):
        rep = AnalyticReplica("r", MODEL, kv_capacity=400_000, mixed=mixed,
                              on_finish=lambda req, t, mixed=mixed: finish.__setitem__(f"{mixed}-{req.input}", t))
        decoder, prompt = Req(0.0, 100, 20), Req(0.01, 8192, 1)
        run_replica(rep, [decoder, prompt])
        if not mixed:
            # 16 prefill-only steps of 512 tokens (their time excludes decode) delay the decoder by them.
            prefill = sum(MODEL.step_time(0, 0.0, 512, 512 * j + 256) for j in range(16))
            assert prompt.first - prompt.start == pytest.approx(prefill, rel=1e-9)
    assert finish["False-100"] > finish["True-100"]


def test_prefix_cache_hits_leading_blocks_in_whole_pages():
    rep = AnalyticReplica("r", MODEL, kv_capacity=400_000, prefix_block_tokens=512, page_tokens=64)
    first = Req(0.0, 1300, 1, blocks=(7, 8, 9))  # 512 + 512 + 276 tokens: 256 of the last cached (whole pages)
    again = Req(10.0, 1300, 1, blocks=(7, 8, 9))
    other = Req(20.0, 1100, 1, blocks=(7, 5, 9))  # shares the first block only
    run_replica(rep, [first, again, other])
    assert (first.cached, again.cached, other.cached) == (0, 1280, 512)
    assert rep.prompt_tokens == 3700 and rep.cached_tokens == 1792


def test_prefix_cache_evicts_least_recent_blocks_beyond_the_kv_pool():
    rep = AnalyticReplica("r", MODEL, kv_capacity=1024, prefix_block_tokens=512, page_tokens=64)
    reqs = [Req(0.0, 512, 1, blocks=(1,)), Req(1.0, 512, 1, blocks=(2,)), Req(2.0, 512, 1, blocks=(1,)),
            Req(3.0, 512, 1, blocks=(3,)), Req(4.0, 512, 1, blocks=(2,)), Req(5.0, 512, 1, blocks=(1,))]
    run_replica(rep, reqs)
    # Block 1 was used again before 3 came, so 3 evicted 2; 1 survives until 2's return evicts it.
    assert [r.cached for r in reqs] == [0, 0, 511, 0, 0, 0]


def test_prefix_cache_evicts_pages_not_whole_blocks():
    # Room for two and a half blocks: the third block takes only the pages it needs from the least
    # recent one, whose first half is still a hit when its prefix comes back.
    rep = AnalyticReplica("r", MODEL, kv_capacity=1280, prefix_block_tokens=512, page_tokens=64)
    reqs = [Req(0.0, 512, 1, blocks=(1,)), Req(1.0, 512, 1, blocks=(2,)), Req(2.0, 512, 1, blocks=(3,)),
            Req(3.0, 600, 1, blocks=(1, 4))]
    run_replica(rep, reqs)
    assert [r.cached for r in reqs] == [0, 0, 0, 256]


def test_a_finished_requests_prefix_becomes_the_most_recent():
    # As the engine inserts a finished sequence into its radix cache (touching its nodes): the
    # long request's block, scheduled first but finished last, outlives the short one's.
    rep = AnalyticReplica("r", MODEL, kv_capacity=1280, prefix_block_tokens=512, page_tokens=64)
    reqs = [Req(0.0, 512, 200, blocks=(1,)), Req(0.001, 512, 1, blocks=(2,)), Req(100.0, 512, 1, blocks=(3,)),
            Req(200.0, 512, 1, blocks=(1,)), Req(300.0, 512, 1, blocks=(2,))]
    run_replica(rep, reqs)
    assert [r.cached for r in reqs] == [0, 0, 0, 511, 256]


def test_a_prompt_waits_unscheduled_until_the_prefill_budget_has_room_and_matches_its_prefix_then():
    rep = AnalyticReplica("r", MODEL, kv_capacity=400_000, prefix_block_tokens=512, page_tokens=64)
    first = Req(0.0, 2048, 4, blocks=(1, 2, 3, 4))
    second = Req(0.0, 2048, 4, blocks=(1, 2, 3, 5))
    rep.add(first, 0.0)
    rep.add(second, 0.0)
    # As in the engine: more than a chunk of the first prompt is left, so the second is not scheduled.
    assert list(rep.prefill) == [first] and list(rep.waiting) == [second] and second.cached == 0
    assert rep.kv_used() == 2049
    while rep.end < math.inf:
        rep.segment_end()
    assert second.cached == 1536 and second.start >= first.start + 2 * MODEL.step_time(0, 0.0, 512, 512)


def test_a_prefix_the_batch_shares_takes_kv_once():
    # Room for one 5,120-token prompt and a little: the second, the same prompt, is scheduled beside
    # the first only because its blocks are the first's, which the pool holds once (as the engine's
    # radix cache does).
    blocks = tuple(range(10))
    finished: list[tuple[Req, float]] = []
    rep = AnalyticReplica("r", MODEL, kv_capacity=6_000, prefix_block_tokens=512, page_tokens=64, mixed=False,
                          on_finish=lambda req, t: finished.append((req, t)))
    first, second = Req(0.0, 5120, 200, blocks=blocks), Req(0.0, 5120, 200, blocks=blocks)
    rep.add(first, 0.0)
    while not rep.B:  # through the first prompt's prefill
        rep.segment_end()
    rep.add(second, rep.t)
    assert list(rep.prefill) == [second] and second.cached == 5119
    assert rep.shared_kv == 5120 and rep.kv_used() == 5121 + 5121 - 5120
    while rep.end < math.inf:
        rep.segment_end()
    assert [req for req, _ in finished] == [first, second] and second.first < finished[0][1]
    assert rep.held == {} and rep.shared_kv == 0 and rep.kv_used() == 0


def test_affinity_places_by_the_replicas_prefix_caches_which_the_router_mirrors():
    # 40 families of 8 requests, each 6 blocks of 512 tokens, interleaved, on replicas whose KV holds
    # a quarter of the families: round-robin scatters a family over the replicas (and evicts it),
    # affinity keeps it where its blocks are cached.
    rng = random.Random(5)
    families = [f * 100 for f in range(40)]
    order = [f for f in families for _ in range(8)]
    rng.shuffle(order)
    arrivals = [(0.05 * i, 3000, 20, 0) for i in range(len(order))]
    blocks = [tuple(range(f, f + 6)) for f in order]
    engine = EngineConfig(kv_capacity_tokens=40_000, mixed_chunk=False)
    hit = {}
    for policy in ("round_robin", "affinity"):
        fleet = FastFleet(FastConfig(replicas=4, policy=policy, engine=engine, admission=False), arrivals,
                          prefix_blocks=blocks, prefix_block_tokens=512)
        assert fleet.run().completed == len(arrivals)
        replicas = [node.replica for node in fleet.nodes.values()]
        hit[policy] = sum(r.cached_tokens for r in replicas) / sum(r.prompt_tokens for r in replicas)
        if policy == "affinity":
            index = fleet.registry.index
            for r in replicas:  # the index holds what each cache holds, from its changes alone
                assert index.blocks_of(r.name) == len(r.prefix_cache)
                assert index.matched_blocks(list(r.prefix_cache)[:1]).get(r.name) == 1
    assert hit["affinity"] > hit["round_robin"] + 0.3, (
        hit
    )  # printed on failure  # at most 7 of 8 requests of a family can hit


# ---- the load sampler ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["least_loaded", "affinity"])
def test_load_sampler_draws_the_same_distribution_as_the_placer(name):
    now = [100.0]
    choices = {}
    for fast in (False, True):
        placer = make_placer(name, clock=lambda: now[0], rng=random.Random(3))
        router = LoadSampler(placer) if fast else placer
        for i in range(12):
            wid = f"w{i:02d}"
            placer.registry.on_heartbeat(m.Heartbeat(worker_id=wid, model="m", engine_url="", started=0, ts=now[0],
                                                     max_running=32))
            placer.registry.on_load(m.WorkerLoad(
                worker_id=wid, model="m", ts=now[0], seq=1, running=i % 7, waiting=0, in_flight=i % 7, max_running=32,
                kv_used_tokens=(950 if i == 11 else 10), kv_capacity_tokens=1000, queued_prefill_tokens=37 * (i % 5),
            ))
        request = m.PlacementRequest(request_id="", model="m", prompt_tokens=300)
        choices[fast] = Counter(router.place(request, record=False).worker_id for _ in range(20_000))
    slow, fast_ = choices[False], choices[True]
    assert "w11" not in fast_ and "w11" not in slow  # KV past the ceiling: filtered on both paths
    for wid in set(slow) | set(fast_):
        p = slow[wid] / 20_000
        sigma = math.sqrt(max(p * (1 - p), 1e-4) / 20_000)
        assert abs(fast_[wid] / 20_000 - p) < 5 * sigma + 0.002, (wid, slow[wid], fast_[wid])


def test_load_sampler_falls_back_when_nothing_is_eligible():
    now = [0.0]
    placer = make_placer("least_loaded", clock=lambda: now[0], rng=random.Random(0))
    sampler = LoadSampler(placer)
    assert sampler.place(m.PlacementRequest(request_id="", model="m", prompt_tokens=10)).worker_id is None
    placer.registry.on_heartbeat(m.Heartbeat(worker_id="a", model="m", engine_url="", started=0, ts=0, max_running=4))
    assert sampler.place(m.PlacementRequest(request_id="", model="m", prompt_tokens=10)).worker_id == "a"
    now[0] = 10.0  # its heartbeat is stale: the placer finds no live worker either
    assert sampler.place(m.PlacementRequest(request_id="", model="m", prompt_tokens=10)).worker_id is None


# ---- against the per-step simulator ----------------------------------------------------------------




@pytest.mark.slow
@pytest.mark.parametrize("policy,load", [("round_robin", 0.75), ("least_loaded", 0.75)])
def test_analytic_fleet_agrees_with_the_per_step_simulator(policy, load):
    engine = EngineConfig()
    trace = workload.azure_like(1500)
    rate = capacity.rate_for_load(trace, engine, replicas=4, load=load)
    trace = workload.at_rate(trace, rate)
    slow = FleetSim(FleetConfig(replicas=4, policy=policy, engine=engine), trace).run()
    fast = FastFleet(FastConfig(replicas=4, policy=policy, engine=engine, admission=False, load_interval_s=0.25),
                     [(r.arrival_s, r.input_tokens, r.output_tokens, 0) for r in trace]).run()
    assert slow.completed == fast.completed == len(trace)
    assert fast.output_tok_s * fast.duration_s == pytest.approx(slow.output_tokens, rel=1e-9)  # same work
    # Stated tolerance: TTFT p50/p90 within 20 %, TPOT p50/p90 within 10 %.
    assert fast.ttft_p50_s == pytest.approx(slow.ttft_p50_s, rel=0.20)
    assert fast.ttft_p90_s == pytest.approx(slow.ttft_p90_s, rel=0.20)
    assert fast.tpot_p50_s == pytest.approx(slow.tpot_p50_s, rel=0.10)
    assert fast.tpot_p90_s == pytest.approx(slow.tpot_p90_s, rel=0.10)
    assert fast.duration_s == pytest.approx(slow.makespan_s + trace[0].arrival_s, rel=0.05)


# ---- the fleet: workloads, controls, billing -------------------------------------------------------


def test_day_workload_reaches_the_peak_and_has_a_night():
    trace = workload.azure_like(3000)
    mix = mix_mod.Mix("t", (mix_mod.TraceClass("t", 1.0, ((1000, 200, 300),)),))
    day = DayWorkload(rate_shape(trace, 60.0), 60.0, 86_400.0, 833.0, mix, seed=1)
    rates = [rate for _, _, rate in day.rates()]
    assert max(rates) == pytest.approx(833.0)
    assert diurnal(4 * 3600) == pytest.approx(0.35) and diurnal(16 * 3600) == pytest.approx(1.0)
    night = [rate for start, _, rate in day.rates() if 3 * 3600 <= start < 5 * 3600]
    assert max(night) < 0.45 * 833
    hour = DayWorkload(rate_shape(trace, 60.0), 60.0, 600.0, 50.0, mix, seed=1)
    arrivals = list(hour.arrivals())
    assert len(arrivals) == pytest.approx(hour.expected_requests(), rel=0.1)
    assert all(a[0] <= b[0] for a, b in zip(arrivals, arrivals[1:]))
    assert arrivals[0][1:] == (1000, 200, 300)
    assert parse_duration("24h") == 86_400 and parse_duration("90m") == 5_400
    with pytest.raises(ValueError):
        parse_duration("soon")


class Scripted:
    """Adds two replicas at the first call, promotes the warm one, drains one later."""

    interval_s = 30.0

    def __init__(self) -> None:
        self.seen: list[FleetSignals] = []

    def decide(self, signals: FleetSignals, fleet: FastFleet) -> None:
        self.seen.append(signals)
        if len(self.seen) == 1:
            fleet.start(1)
            fleet.promote(1)
        if len(self.seen) == 8:
            fleet.drain(2)


def test_controller_hooks_change_the_fleet_and_billing_counts_every_started_replica():
    mix = mix_mod.load("worked-example")
    controller = Scripted()
    config = FastConfig(replicas=2, warm=1, admission=False, cold_start_s=120.0, warm_start_s=5.0)
    summary = FastFleet(config, constant(3.0, 600.0, mix, seed=2), controller=controller).run()
    first, later = controller.seen[0], controller.seen[2]
    assert (first.serving, first.warm, first.starting) == (2, 1, 0)
    assert first.arrival_rps == pytest.approx(3.0, rel=0.4) and len(first.running) == 2
    assert (later.serving, later.warm, later.starting) == (3, 0, 1)  # promoted after 5 s; cold start pending
    assert controller.seen[6].serving == 4  # the cold start finished 120 s after t = 30
    assert controller.seen[8].serving == 2
    assert len(controller.seen[8].serving_ids) == 2 and controller.seen[8].warm_ids == ()
    assert summary.completed == summary.requests and summary.unfinished == 0
    # Billed: 3 replicas from 0, a 4th from 30 s; two stop once drained after 240 s.
    assert summary.gpu_hours * 3600 / 2 >= 3 * 240 + 210
    assert summary.gpu_hours * 3600 / 2 <= 3 * summary.duration_s + (summary.duration_s - 30)


@pytest.mark.slow
def test_overload_sheds_with_the_gateway_policy():
    mix = mix_mod.load("worked-example")
    config = FastConfig(replicas=1, admission=True, admission_budget_s=1.0)
    summary = FastFleet(config, constant(40.0, 120.0, mix, seed=1)).run()
    assert summary.rejected > 0
    assert summary.completed + summary.rejected == summary.requests


@pytest.mark.slow
def test_same_seed_same_run():
    mix = mix_mod.load("worked-example")
    runs = [FastFleet(FastConfig(replicas=6, seed=4), constant(20.0, 120.0, mix, seed=4)).run().as_dict(series=False)
            for _ in range(2)]
    for run in runs:
        for key in ("cpu_s", "wall_s", "req_per_cpu_s"):
            run.pop(key)
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_simulate_cli_writes_its_report(tmp_path):
    from tools.commands.main import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {int(r.arrival_s * 1000)}, "input_length": {r.input_tokens}, "output_length": '
        f'{r.output_tokens}}}\n'
        for r in workload.azure_like(600)))
    result = CliRunner().invoke(main, [
        "simulate", "--trace", str(trace), "--duration", "10m", "--peak-rps", "20", "--fleet", "H100:2x4",
        "--out", str(tmp_path / "out"), "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    assert "minutes within SLO" in result.output
    assert "; affinity; " in result.output  # placed as the router places by default
    assert (tmp_path / "out" / "simulate.json").exists() and (tmp_path / "out" / "simulate.png").exists()
    bad = CliRunner().invoke(main, ["simulate", "--trace", str(trace), "--fleet", "A100:2x4"])
    assert bad.exit_code != 0 and "H100:2x234" in bad.output


@pytest.mark.slow
def test_simulate_cli_autoscales_with_the_autoscalers_policy(tmp_path):
    from tools.commands.main import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {int(r.arrival_s * 1000)}, "input_length": {r.input_tokens}, "output_length": '
        f'{r.output_tokens}}}\n'
        for r in workload.azure_like(600)))
    gpu_hours = {}
    for name, extra in (("static", []), ("autoscaled", ["--autoscale", "--cold-start", "30"])):
        result = CliRunner().invoke(main, [
            "simulate", "--trace", str(trace), "--duration", "10m", "--peak-rps", "10", "--fleet", "H100:2x12",
            "--out", str(tmp_path / name), "--no-progress", *extra,
        ])
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / name / "simulate.json").read_text())
        gpu_hours[name] = report["summary"]["gpu_hours"]
    assert "autoscaled from" in result.output
    assert report["inputs"]["autoscale"] and report["inputs"]["autoscaler"]["cold_start_s"] == 30.0
    # 12 replicas for a peak that needs a few: the autoscaler runs far fewer.
    assert gpu_hours["autoscaled"] < 0.7 * gpu_hours["static"], gpu_hours


def test_drain_to_warm_keeps_the_replica_billed_and_promotable():
    mix = mix_mod.load("worked-example")

    class ToWarm:
        interval_s = 20.0
        calls = 0

        def decide(self, signals: FleetSignals, fleet: FastFleet) -> None:
            self.calls += 1
            if self.calls == 1:
                assert fleet.drain(ids=[signals.serving_ids[0]], to_warm=True) == [signals.serving_ids[0]]
            if self.calls == 5:
                assert signals.warm == 1 and signals.serving == 2 and signals.warm_ids
                fleet.promote(ids=list(signals.warm_ids))

    controller = ToWarm()
    summary = FastFleet(FastConfig(replicas=3, admission=False), constant(4.0, 200.0, mix, seed=3),
                        controller=controller).run()
    assert summary.completed == summary.requests
    assert summary.gpu_hours * 3600 == pytest.approx(3 * 2 * summary.duration_s, rel=1e-6)  # never stopped


class Busy:
    """Starts, promotes, drains (to the warm pool and for good) and records every signal."""

    interval_s = 15.0

    def __init__(self) -> None:
        self.seen: list[FleetSignals] = []

    def decide(self, signals: FleetSignals, fleet: FastFleet) -> None:
        self.seen.append(signals)
        calls = len(self.seen)
        if calls == 1:
            fleet.start(1)
            fleet.promote(1)
        elif calls == 4:
            fleet.drain(1, to_warm=True)
        elif calls == 9:
            fleet.promote(1)
        elif calls == 12:
            fleet.drain(2)


@pytest.mark.slow
@pytest.mark.parametrize("policy,max_virtual_s", [("least_loaded", None), ("affinity", None), ("least_loaded", 200.0)])
def test_lazy_replicas_give_the_same_run_as_eager_ones(policy, max_virtual_s):
    """Applying segment ends on demand (the default) changes no result: every number, every
    minute and every controller signal equals the run where each segment end is a heap event."""
    mix = mix_mod.load("worked-example")
    runs, seen = [], []
    for lazy in (True, False):
        controller = Busy()
        config = FastConfig(replicas=4, warm=1, policy=policy, seed=3, lazy_replicas=lazy, cold_start_s=60.0,
                            admission_budget_s=0.5, max_virtual_s=max_virtual_s)
        run = FastFleet(config, constant(24.0, 300.0, mix, seed=7), controller=controller).run().as_dict()
        for key in ("cpu_s", "wall_s", "req_per_cpu_s", "events"):
            run.pop(key)
        runs.append(run)
        seen.append(controller.seen)
    assert runs[0] == runs[1]
    assert seen[0] == seen[1]
    assert runs[0]["completed"] > 3000


def test_simulate_places_as_the_live_router_does_by_default(monkeypatch):
    from services.router.settings import RouterSettings
    from services.worker.settings import WorkerSettings
    from tools.commands.simulate import simulate

    monkeypatch.delenv("INFERBUS_ROUTER_POLICY", raising=False)
    monkeypatch.delenv("INFERBUS_LOAD_INTERVAL_S", raising=False)
    defaults = {p.name: p.default for p in simulate.params}
    assert defaults["policy"] == RouterSettings().policy
    assert defaults["load_interval"] == WorkerSettings().load_interval_s  # the router hears load as often
