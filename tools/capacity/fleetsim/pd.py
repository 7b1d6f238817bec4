"""A disaggregated fleet in virtual time: a prefill pool, a decode pool and the KV link between them.

The replicas are the fast simulator's (`analytic.AnalyticReplica`, the same step-time model the
planner and the simulated engine use), run eagerly (every segment end is an event). One request:

1. it arrives; the pair is placed: a prefill replica by the least queued prefill work (its
   unfinished prompt tokens: the pairing's prefill signal), a decode replica by the fewest requests
   (running, waiting, and on their way in) among those with KV room for the prompt, else the one
   with the most room (the pairing's decode signal, `services.router.pairing`);
2. the decode replica reserves the prompt's KV at once (SGLang's decode engine allocates it when
   the pair is placed, before the prefill runs): its KV capacity is that much smaller until the KV
   lands, so its own admission sees the reservation;
3. the prefill replica computes the prompt's uncached tokens in chunks, among its other prompts
   (its prefix hits are the arrival's cached tokens, as the planner's mix gives them); the prompt's
   first token comes with its last chunk;
4. the KV of the whole prompt (the decode engine holds no prefix of it) crosses the prefill
   replica's link, one transfer after another (`KvLink.transfer_s`, the planner's arithmetic),
   starting when the prefill ends (conservative: SGLang sends each chunk's KV as it is computed);
5. when it has landed, the reservation becomes the request's KV and the decode replica takes the
   request in at its next step boundary, with one prompt token left to compute (a one-token
   prefill in a decode step, which emits the first token), then one token a step.

TTFT is arrival → the decode replica's first token; TPOT the decode replica's steps after it.
`aggregated=True` runs the same requests on one pool of aggregated replicas (chunked prefill
mixed into decode steps, placed by the least unfinished work) so that both topologies are
measured by the same machinery. Minutes are judged as `inferbus simulate` judges them: within the
SLO when that minute's finished requests have TTFT p90 and TPOT p90 within it.

With a `controller` (duck-typed: `decide(now, signals, fleet)`, e.g.
`services.autoscaler.simulated_pd.PdPolicyController`, which runs the autoscaler's own
`DisaggregatedPolicy`) the pools are sized as the fleet runs: every `interval_s` the fleet measures
each pool as its workers would report it (`RoleSignals`) and the controller starts replicas (ready
warm after `cold_start_s`), promotes warm ones (serving after `warm_start_s`), drains serving ones
(no new requests; warm once empty) and stops warm ones. GPU-hours count every replica from its
start to its stop.

Pure: no wall clock; runs on `events.EventLoop`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from inferbus.timing import KV_LINKS, KvLink, StepTimeModel, roofline
from services.sim_engine.config import EngineConfig
from tools.capacity.fleetsim.analytic import AnalyticReplica, Req
from tools.capacity.fleetsim.events import EventLoop
from tools.capacity.fleetsim.timeseries import quantiles

Arrival = tuple[float, int, int, int]  # (time s, input tokens, output tokens, cached prompt tokens)


@dataclass(frozen=True)
class Pool:
    replicas: int
    engine: EngineConfig

    @property
    def gpus(self) -> int:
        return self.replicas * self.engine.tp


@dataclass(frozen=True)
class PdConfig:
    decode: Pool  # with `aggregated`, the one pool
    prefill: Pool | None = None  # None: aggregated
    link: KvLink = KV_LINKS["rdma"]
    slo_ttft_s: float = 0.8
    slo_tpot_s: float = 0.040
    bucket_s: float = 60.0
    drain_timeout_s: float = 3600.0  # after the last arrival, give up on what is still unfinished

    @property
    def aggregated(self) -> bool:
        return self.prefill is None

    @property
    def gpus(self) -> int:
        return self.decode.gpus + (self.prefill.gpus if self.prefill else 0)


@dataclass
class PdSummary:
    topology: str
    gpus: int
    requests: int
    completed: int
    duration_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    request_attainment: float  # share of requests within both SLOs
    minutes: int
    minute_attainment: float  # share of minutes whose p90s are within the SLO
    goodput_rps: float  # requests within the SLO per second
    transfer_mean_s: float
    decode_kv_peak: float  # highest share of a decode replica's KV in use (reservations included)
    series: list[dict[str, float]] = field(default_factory=list)
    gpu_hours: float = math.nan  # every replica from its start to its stop (static: GPUs × duration)

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.gpus if self.gpus else math.nan

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("series", "pools")}
        out["goodput_rps_per_gpu"] = self.goodput_per_gpu
        return out


@dataclass(frozen=True)
class RoleSignals:
    """One pool as its workers' load reports would show it to the autoscaler (the fields of
    `services.autoscaler.signals.PoolSignals` the simulator can measure)."""

    serving: int
    warm: int
    starting: int
    draining: int
    slots: int
    arrival_rate: float  # requests per second over the last rate window (every request passes both pools)
    in_flight: int
    waiting: int
    queue_wait_s: float  # p90, arrival → its prefill starting (prefill pool)
    kv_usage: float  # fullest serving replica, reservations included
    ttft_p90_s: float | None  # prefill: arrival → KV landed (its workers' accept → KV sent)
    tpot_p90_s: float | None  # decode


RATE_WINDOW_S = 10.0
LATENCY_WINDOW_S = 30.0
MIN_SAMPLES = 5


def _p90(values: list[float]) -> float | None:
    return quantiles(values, 0.9)[0] if len(values) >= MIN_SAMPLES else None


def _replica(name: str, engine: EngineConfig, model: StepTimeModel, on_finish) -> AnalyticReplica:  # type: ignore[no-untyped-def]
    capacity = engine.kv_capacity_tokens or roofline(engine.gpu, engine.tp, engine.preset).kv_capacity_tokens()
    return AnalyticReplica(name, model, kv_capacity=capacity, chunk=engine.chunked_prefill_size,
                           max_running=engine.max_running_requests, on_finish=on_finish, mixed=engine.mixed_chunk,
                           page_tokens=engine.block_size)


class PdFleet:
    """Replays `arrivals` (time-sorted) on the fleet; `run()` returns a `PdSummary`."""

    def __init__(self, config: PdConfig, arrivals: Iterable[Arrival], controller: Any = None, interval_s: float = 5.0,
                 cold_start_s: float = 120.0, warm_start_s: float = 5.0) -> None:
        self.config = config
        self.controller = controller
        self.interval_s, self.cold_start_s, self.warm_start_s = interval_s, cold_start_s, warm_start_s
        self.loop = EventLoop()
        self.arrivals = iter(arrivals)
        d = config.decode.engine
        self.decode_model = roofline(d.gpu, d.tp, d.preset)
        self.decoders = [_replica(f"decode-{i}", d, self.decode_model, self._decode_finished)
                         for i in range(config.decode.replicas)]
        self.prefillers: list[AnalyticReplica] = []
        if config.prefill is not None:
            p = config.prefill.engine
            model = roofline(p.gpu, p.tp, p.preset)
            self.prefillers = [_replica(f"prefill-{i}", p, model, self._prefill_finished)
                               for i in range(config.prefill.replicas)]
        self.link_free = [0.0] * len(self.prefillers)
        self.incoming = [0] * len(self.decoders)  # requests reserved on each decoder, KV not landed
        self.reserved = [0] * len(self.decoders)  # their KV tokens
        self.capacity = [r.kv_capacity for r in self.decoders]
        self.pairs: dict[int, tuple[int, int, Req]] = {}  # id(prefill req) → (prefill, decoder, request)
        self.finished: list[Req] = []
        self.requests = 0
        self.transfer_s = 0.0
        self.kv_peak = 0.0
        self.last_arrival = 0.0
        # Autoscaling: each replica's phase (serving, waking: promoted, serving after the warm start;
        # starting, warm, draining, off) and when it was last started, for GPU-hours.
        self.phase: dict[str, list[str]] = {"decode": ["serving"] * len(self.decoders),
                                            "prefill": ["serving"] * len(self.prefillers)}
        self.up_since: dict[str, list[float]] = {"decode": [0.0] * len(self.decoders),
                                                 "prefill": [0.0] * len(self.prefillers)}
        self.gpu_seconds = 0.0
        self.arrived: deque[float] = deque()
        self.landed: deque[tuple[float, float, float]] = deque()  # (t, arrival → landed, arrival → prefill start)
        self.decoded: deque[tuple[float, float]] = deque()  # (t, TPOT)
        self.pool_series: list[dict[str, float]] = []
        self._arrivals_done = False

    # ---- replicas as events ------------------------------------------------------------------

    def _schedule(self, replica: AnalyticReplica, end: float) -> None:
        if end < math.inf:
            self.loop.at(end, self._segment, replica, replica.version)

    def _segment(self, replica: AnalyticReplica, version: int) -> None:
        if replica.version == version:
            self._schedule(replica, replica.segment_end())

    def _add(self, replica: AnalyticReplica, req: Req) -> None:
        self._schedule(replica, replica.add(req, self.loop.now))

    # ---- placement ---------------------------------------------------------------------------

    @staticmethod
    def _unfinished_prefill(replica: AnalyticReplica) -> int:
        return replica.Q + sum(r.remaining for r in replica.waiting)

    def _place_prefill(self) -> int:
        phase = self.phase["prefill"]
        loads = [(self._unfinished_prefill(r) if phase[i] == "serving" else math.inf, i)
                 for i, r in enumerate(self.prefillers)]
        return min(loads)[1]

    def _place_decode(self, tokens: int) -> int:
        best, best_key = 0, (math.inf, math.inf)
        phase = self.phase["decode"]
        for i, replica in enumerate(self.decoders):
            if phase[i] != "serving":
                continue
            free = self.capacity[i] - self.reserved[i] - replica.kv_used()
            key = (0 if free >= tokens else 1, replica.in_flight + self.incoming[i] if free >= tokens else -free)
            if key < best_key:
                best, best_key = i, key
        return best

    def _place_aggregated(self) -> int:
        loads = [(self._unfinished_prefill(r), r.in_flight) for r in self.decoders]
        return loads.index(min(loads))

    # ---- one request -------------------------------------------------------------------------

    def _arrive(self, t: float, n_in: int, n_out: int, cached: int) -> None:
        self.requests += 1
        self.last_arrival = t
        if self.controller is not None:
            self.arrived.append(t)
        if self.config.aggregated:
            self._add(self.decoders[self._place_aggregated()], Req(t, n_in, n_out, cached))
            return
        decoder = self._place_decode(n_in + 1)
        self.incoming[decoder] += 1
        self.reserved[decoder] += n_in + 1
        self._set_capacity(decoder)
        prefill = self._place_prefill()
        request = Req(t, n_in, n_out, cached)
        job = Req(t, n_in, 1, cached)  # the prefill's part: the prompt and its first token
        self.pairs[id(job)] = (prefill, decoder, request)
        self._add(self.prefillers[prefill], job)

    def _set_capacity(self, decoder: int) -> None:
        replica = self.decoders[decoder]
        replica.kv_capacity = self.capacity[decoder] - self.reserved[decoder]
        used = (replica.kv_used() + self.reserved[decoder]) / self.capacity[decoder]
        self.kv_peak = max(self.kv_peak, used)

    def _prefill_finished(self, job: Req, t: float) -> None:
        prefill, decoder, request = self.pairs.pop(id(job))
        p, d = self.config.prefill, self.config.decode
        assert p is not None
        start = max(t, self.link_free[prefill])
        took = self.config.link.transfer_s(request.input, p.engine.tp, d.engine.tp, self.decode_model.model)
        self.link_free[prefill] = start + took
        self.transfer_s += self.link_free[prefill] - t
        self.loop.at(start + took, self._landed, decoder, request, job.start)

    def _landed(self, decoder: int, request: Req, start: float = -1.0) -> None:
        if self.controller is not None:
            self.landed.append((self.loop.now, self.loop.now - request.arrival, max(0.0, start - request.arrival)))
        self.incoming[decoder] -= 1
        self.reserved[decoder] -= request.input + 1
        self._set_capacity(decoder)
        # The prompt's KV is here: one token left to compute, which emits the first token.
        request.set_cached(request.input - 1)
        self._add(self.decoders[decoder], request)

    def _decode_finished(self, request: Req, t: float) -> None:
        request.finish = t
        self.finished.append(request)
        if self.controller is not None and request.output > 1:
            self.decoded.append((t, (t - request.first) / (request.output - 1)))

    # ---- autoscaling: what the controller sees and does ----------------------------------------

    def _replicas(self, role: str) -> list[AnalyticReplica]:
        return self.prefillers if role == "prefill" else self.decoders

    def _tp(self, role: str) -> int:
        pool = self.config.prefill if role == "prefill" else self.config.decode
        assert pool is not None
        return pool.engine.tp

    def _busy(self, role: str, i: int) -> bool:
        replica = self._replicas(role)[i]
        return replica.in_flight > 0 or (role == "decode" and self.incoming[i] > 0)

    def signals(self) -> dict[str, RoleSignals]:
        now = self.loop.now
        for window, keep in ((self.arrived, RATE_WINDOW_S), (self.landed, LATENCY_WINDOW_S),
                             (self.decoded, LATENCY_WINDOW_S)):
            while window and now - (window[0] if isinstance(window[0], float) else window[0][0]) > keep:
                window.popleft()
        rate = len(self.arrived) / RATE_WINDOW_S
        out = {}
        for role in ("prefill", "decode"):
            phase, replicas = self.phase[role], self._replicas(role)
            serving = [i for i, p in enumerate(phase) if p == "serving"]
            kv = 0.0
            if role == "decode":
                kv = max(((replicas[i].kv_used() + self.reserved[i]) / self.capacity[i] for i in serving), default=0.0)
            out[role] = RoleSignals(
                serving=sum(1 for p in phase if p in ("serving", "waking")), warm=phase.count("warm"),
                starting=phase.count("starting"), draining=phase.count("draining"),
                slots=sum(replicas[i].max_running for i in serving), arrival_rate=rate,
                in_flight=sum(replicas[i].in_flight for i in serving) + (
                    sum(self.incoming[i] for i in serving) if role == "decode" else 0),
                waiting=sum(len(replicas[i].waiting) for i in serving),
                queue_wait_s=(_p90([w for _, _, w in self.landed]) or 0.0) if role == "prefill" else 0.0,
                kv_usage=kv,
                ttft_p90_s=_p90([x for _, x, _ in self.landed]) if role == "prefill" else None,
                tpot_p90_s=_p90([x for _, x in self.decoded]) if role == "decode" else None)
        return out

    def start(self, role: str, count: int) -> None:
        """Launch `count` replicas: warm after the cold start (an off replica is reused first)."""
        for _ in range(count):
            phase = self.phase[role]
            if "off" in phase:
                i = phase.index("off")
            else:
                i = len(phase)
                pool = self.config.prefill if role == "prefill" else self.config.decode
                assert pool is not None
                if role == "prefill":
                    model = roofline(pool.engine.gpu, pool.engine.tp, pool.engine.preset)
                    self.prefillers.append(_replica(f"prefill-{i}", pool.engine, model, self._prefill_finished))
                    self.link_free.append(0.0)
                else:
                    replica = _replica(f"decode-{i}", pool.engine, self.decode_model, self._decode_finished)
                    self.decoders.append(replica)
                    self.incoming.append(0)
                    self.reserved.append(0)
                    self.capacity.append(replica.kv_capacity)
                phase.append("off")
                self.up_since[role].append(0.0)
            phase[i] = "starting"
            self.up_since[role][i] = self.loop.now
            self.loop.at(self.loop.now + self.cold_start_s, self._ready, role, i)

    def _ready(self, role: str, i: int) -> None:
        if self.phase[role][i] == "starting":
            self.phase[role][i] = "warm"

    def promote(self, role: str, count: int) -> None:
        warm = [i for i, p in enumerate(self.phase[role]) if p == "warm"][:count]
        for i in warm:
            self.phase[role][i] = "waking"
            self.loop.at(self.loop.now + self.warm_start_s, self._woken, role, i)

    def _woken(self, role: str, i: int) -> None:
        if self.phase[role][i] == "waking":
            self.phase[role][i] = "serving"

    def drain(self, role: str, count: int) -> None:
        """Take `count` serving replicas (least loaded first) out of placement; warm once empty."""
        replicas = self._replicas(role)
        serving = sorted((replicas[i].in_flight, i) for i, p in enumerate(self.phase[role]) if p == "serving")
        for _, i in serving[:count]:
            self.phase[role][i] = "draining"

    def stop_warm(self, role: str, count: int) -> None:
        for i in [i for i, p in enumerate(self.phase[role]) if p == "warm"][:count]:
            self.phase[role][i] = "off"
            self.gpu_seconds += (self.loop.now - self.up_since[role][i]) * self._tp(role)

    def _tick(self) -> None:
        now = self.loop.now
        for role in ("prefill", "decode"):
            for i, p in enumerate(self.phase[role]):
                if p == "draining" and not self._busy(role, i):
                    self.phase[role][i] = "warm"
        signals = self.signals()
        self.controller.decide(now, signals, self)
        row: dict[str, float] = {"t_s": now, "arrival_rps": signals["decode"].arrival_rate}
        for role in ("prefill", "decode"):
            phase = self.phase[role]
            row[f"{role}_serving"] = sum(1 for p in phase if p in ("serving", "waking"))
            row[f"{role}_up"] = sum(1 for p in phase if p != "off")
        self.pool_series.append(row)
        if not self._done():
            self.loop.at(now + self.interval_s, self._tick)

    def _done(self) -> bool:
        return self._arrivals_done and all(not self._busy(role, i) for role in ("prefill", "decode")
                                           for i in range(len(self._replicas(role))))

    # ---- running -----------------------------------------------------------------------------

    def _next_arrival(self) -> None:
        arrival = next(self.arrivals, None)
        if arrival is None:
            self._arrivals_done = True
            return
        t, n_in, n_out, cached = arrival
        self.loop.at(t, self._arrival_then_next, t, n_in, n_out, cached)

    def _arrival_then_next(self, t: float, n_in: int, n_out: int, cached: int) -> None:
        self._arrive(t, n_in, n_out, cached)
        self._next_arrival()

    def run(self) -> PdSummary:
        if not self.decoders or (not self.config.aggregated and not self.prefillers):
            raise ValueError("every pool needs at least one replica")
        self._next_arrival()
        if self.controller is not None:
            self.loop.at(self.interval_s, self._tick)
        while len(self.loop):
            self.loop.run(until=self.loop.now + 600.0)
            if self.loop.now > self.last_arrival + self.config.drain_timeout_s:
                break
        return self._summary()

    def _summary(self) -> PdSummary:
        c = self.config
        done = self.finished
        ttft = [r.first - r.arrival for r in done]
        tpot = [(r.finish - r.first) / (r.output - 1) for r in done if r.output > 1]
        good = sum(1 for r, a in zip(done, ttft) if a <= c.slo_ttft_s and
                   (r.output <= 1 or (r.finish - r.first) / (r.output - 1) <= c.slo_tpot_s))
        buckets: dict[int, list[Req]] = {}
        for r in done:
            buckets.setdefault(int(r.finish // c.bucket_s), []).append(r)
        series = []
        for index in sorted(buckets):
            group = buckets[index]
            b_ttft = quantiles([r.first - r.arrival for r in group], 0.9)[0]
            tp = [(r.finish - r.first) / (r.output - 1) for r in group if r.output > 1]
            b_tpot = quantiles(tp, 0.9)[0] if tp else 0.0
            series.append({"t_s": index * c.bucket_s, "completed": len(group), "ttft_p90_s": b_ttft,
                           "tpot_p90_s": b_tpot,
                           "within_slo": float(b_ttft <= c.slo_ttft_s and b_tpot <= c.slo_tpot_s)})
        duration = max(self.last_arrival, 1e-9)
        t50, t90 = quantiles(ttft, 0.5, 0.9) if ttft else (math.nan, math.nan)
        p50, p90 = quantiles(tpot, 0.5, 0.9) if tpot else (math.nan, math.nan)
        return PdSummary(
            topology="aggregated" if c.aggregated else "disaggregated",
            gpus=c.gpus,
            requests=self.requests,
            completed=len(done),
            duration_s=duration,
            ttft_p50_s=t50,
            ttft_p90_s=t90,
            tpot_p50_s=p50,
            tpot_p90_s=p90,
            request_attainment=good / self.requests if self.requests else math.nan,
            minutes=len(series),
            minute_attainment=sum(s["within_slo"] for s in series) / len(series) if series else math.nan,
            goodput_rps=good / duration,
            transfer_mean_s=self.transfer_s / len(done) if done and not c.aggregated else 0.0,
            decode_kv_peak=self.kv_peak,
            series=series,
            gpu_hours=self._gpu_hours(duration),
        )

    def _gpu_hours(self, duration: float) -> float:
        if self.controller is None:
            return self.config.gpus * duration / 3600.0
        end = self.loop.now
        seconds = self.gpu_seconds + sum((end - self.up_since[role][i]) * self._tp(role)
                                         for role in ("prefill", "decode")
                                         for i, p in enumerate(self.phase[role]) if p != "off")
        return seconds / 3600.0
