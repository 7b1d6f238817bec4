"""The fast fleet simulator: analytic replicas behind the production placement and admission policies.

One virtual clock, one event heap, no network. What runs is production code where it decides,
wired as in the per-step simulator (`wiring`):

- placement: `services.router.placement` (least-loaded or affinity), its registry fed `Heartbeat`
  and `WorkerLoad` messages as the router service's is. The simulator draws placements with a
  `sampler.LoadSampler` (the same choice distribution as `Placer.place`, O(√n) in C instead of
  O(workers) in Python). Requests carry no prefix hashes (Azure traces have none;
  cache hits are statistical, from the mix's cached fraction), so placement is load-only. Given a
  prefix trace's block ids (`prefix_blocks`), replicas keep prefix caches, and with the `affinity`
  policy the router sees them as it sees an engine's: a request's full blocks are its prefix
  hashes (the router's block is the trace's, `prefix_block_tokens`), and each replica's cache
  changes (blocks taken in, blocks evicted) reach the router's prefix index at once, as the engines'
  KV events would ~1 ms later, without the message objects. Requests whose blocks the index does not
  know still take the sampler's load-only draw.
- admission: `services.gateway.overload.OverloadPolicy` (sheds a request whose expected wait
  exceeds its band's budget), fed the same load reports. Its inputs change only when reports
  arrive, so its verdict is re-evaluated every `admission_refresh_s` rather than per request.
  Per-tenant quotas (Redis-backed in the gateway) are not simulated.
- engines: `analytic.AnalyticReplica` (the engine's timing model, a few events per request).

For speed (the results are the same): while arrivals remain, a serving replica's segment ends are
not heap events but are applied when something looks at the replica (`_catch_up`); placement goes
through the sampler's `place_load_only` (no message objects); finished requests are accounted in
batches (`_account_finished`).

Load reports go every `load_interval_s` per replica (the fleet is split into cohorts reporting in
turn, one heap event per cohort), heartbeats every `heartbeat_interval_s` (an unchanged beat
through `WorkerRegistry.touch`); both reach the router at once (a bus delay of ~1 ms is below the model's
resolution). A placement the policy answers with no worker (nothing eligible) waits on a shared
queue until a replica has room.

The fleet changes under a `Controller`, called every `interval_s` with `FleetSignals`, through
`start`, `promote`, `drain` and `stop_warm` (see `docs/simulator.md`). Replica lifecycle:
starting (cold start, `cold_start_s`) → serving, or → warm (loaded, not serving, billed) →
promoted (warm start, `warm_start_s`) → serving → draining (no new work, finishes its own) →
stopped. Every started replica is billed: GPU-hours = ∫ (starting + warm + serving + draining) ·
TP dt.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from inferbus.timing import FixedStepModel, StepTimeModel, roofline
from proto import messages as m
from services.router.config import RoutingConfig
from services.sim_engine.config import DEFAULT_MODEL, EngineConfig
from tools.capacity.fleetsim.analytic import AnalyticReplica, Req
from tools.capacity.fleetsim.timeseries import INF, Bucket, Minute, Summary, close, minute_attainment, quantiles
from tools.capacity.fleetsim.wiring import (
    Admission,
    Controller,
    FleetSignals,
    Lifecycle,
    StaticController,
    fleet_signals,
    fleet_states,
    make_placement,
)

__all__ = ["Arrival", "Controller", "FastConfig", "FastFleet", "FleetSignals", "StaticController"]

# One arrival: (time s, input tokens, output tokens, cached prompt tokens).
Arrival = tuple[float, int, int, int]

_SEGMENT, _TICK, _CONTROL, _READY, _EXPIRE, _BUCKET = range(6)


@dataclass
class FastConfig:
    replicas: int = 8  # serving at t = 0
    warm: int = 0  # warm (loaded, not serving) at t = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    policy: str = "least_loaded"  # least_loaded | affinity | round_robin (round_robin has no fast path)
    routing: object | None = None  # services.router.config.RoutingConfig; None: its defaults
    fast_placement: bool = True  # draw with a `LoadSampler` (same distribution; off: `Placer.place`, O(n))
    seed: int = 0
    model: str = DEFAULT_MODEL
    # The live worker reports every 0.25 s; between reports the router counts its own placements,
    # so 1 s changes little here and halves the simulator's cost of reports (bench/simulate.md).
    load_interval_s: float = 1.0
    heartbeat_interval_s: float = 1.0
    report_cohorts: int = 10  # replicas report in this many groups spread over the interval
    expire_interval_s: float = 1.0
    admission: bool = True
    admission_budget_s: float = 3.0  # the gateway's standard band (OverloadPolicy default)
    admission_refresh_s: float = 0.25
    cold_start_s: float = 120.0
    warm_start_s: float = 5.0
    slo_ttft_s: float = 0.8
    slo_tpot_s: float = 0.040
    bucket_s: float = 60.0
    price_per_gpu_hour: float = 2.50
    # Apply serving replicas' segment ends when something looks at them rather than as heap
    # events (the same results, faster; False: every segment end is a heap event).
    lazy_replicas: bool = True
    # Stop at this virtual time (requests still in flight count as unfinished); None: drain all.
    max_virtual_s: float | None = None
    # After the last arrival, give up on requests not finished within this long (a fleet with no
    # serving replica left, say); they count as unfinished.
    drain_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.warm < 0:
            raise ValueError("replicas and warm must not be negative")
        if self.load_interval_s <= 0 or self.heartbeat_interval_s <= 0 or self.bucket_s <= 0:
            raise ValueError("intervals must be positive")
        if self.report_cohorts < 1:
            raise ValueError("report_cohorts must be at least 1")


class _Node:
    """A replica's fleet-side state."""

    __slots__ = ("name", "replica", "state", "cohort", "seq", "reports", "beat", "since", "warm_target")

    def __init__(self, name: str, replica: AnalyticReplica, cohort: int) -> None:
        self.name = name
        self.replica = replica
        self.state = "starting"  # starting | warm | serving | draining | stopped
        self.cohort = cohort
        self.seq = 0
        self.reports = 0
        self.beat: m.Heartbeat | None = None
        self.since = 0.0
        self.warm_target = False  # a cold start that ends in the warm pool

    @property
    def in_flight(self) -> int:
        return self.replica.in_flight


class FastFleet:
    """Replays `arrivals` (time-sorted) on the fleet; `run()` returns a `Summary`."""

    def __init__(
        self,
        config: FastConfig,
        arrivals: Iterable[Arrival],
        *,
        controller: Controller | None = None,
        step_model: StepTimeModel | None = None,
        progress: Callable[[float], None] | None = None,
        prefix_blocks: list[tuple[int, ...]] | None = None,
        prefix_block_tokens: int = 512,
    ) -> None:
        """`prefix_blocks`: the i-th arrival's prefix block ids (a Mooncake trace's `hash_ids`, one
        per `prefix_block_tokens` prompt tokens): every replica then keeps a prefix cache and a
        request's hits are what it finds there rather than its arrival's cached tokens. The
        `affinity` policy places by them (see the module's docstring); the others do not look."""
        self.config = config
        engine = config.engine
        # The router sees prefixes in the trace's blocks: its block size is theirs.
        self._prefix_routing = prefix_blocks is not None and config.policy == "affinity"
        routing = config.routing
        if self._prefix_routing:
            routing = replace(routing if isinstance(routing, RoutingConfig) else RoutingConfig(),
                              block_size=prefix_block_tokens)
        self.step_model = step_model or (
            FixedStepModel(engine.fixed_step_ms / 1000.0) if engine.fixed_step_ms is not None
            else roofline(engine.gpu, engine.tp, engine.preset)
        )
        self.kv_capacity = (
            engine.kv_capacity_tokens or roofline(engine.gpu, engine.tp, engine.preset).kv_capacity_tokens()
        )
        self.now = 0.0
        self.heap: list[tuple[float, int, int, object, int]] = []
        self._seq = 0
        self.rng = random.Random(config.seed)
        self.placer, self.sampler = make_placement(config.policy, routing, engine.block_size,  # type: ignore[arg-type]
                                                   self.clock, config.seed, sampler=config.fast_placement)
        self.registry = self.placer.registry
        self.admission = Admission(self.clock, config.admission_budget_s, config.admission_refresh_s)
        self.controller: Controller = controller or StaticController()
        self.progress = progress
        self._arrivals: Iterator[Arrival] = iter(arrivals)
        self._prefix_blocks = prefix_blocks
        self._prefix_block_tokens = prefix_block_tokens if prefix_blocks is not None else 0
        self.nodes: dict[str, _Node] = {}
        self._cohorts: list[list[_Node]] = [[] for _ in range(config.report_cohorts)]
        self.serving: dict[str, AnalyticReplica] = {}  # placement targets (draining ones stay reachable by id)
        self.by_id: dict[str, _Node] = {}
        self.shared: deque[Req] = deque()
        self._next_id = 0
        self._cohort = 0
        self._started = 0  # billed replicas now
        self._gpu_s = 0.0
        self._billed_at = 0.0
        self._peak_serving = 0
        # Metrics.
        self.requests = 0
        self.completed = 0
        self.rejected = 0
        self.good = 0
        self.good_tokens = 0
        self.output_tokens = 0
        self.events = 0
        self._buckets: dict[int, Bucket] = {}
        self.series: list[Minute] = []
        self._all_ttft: list[float] = []
        self._all_tpot: list[float] = []
        # Requests carry no adapter and no prefix hashes: `place_load_only` is `place` for them,
        # without the message objects.
        self._place = self.sampler.place_load_only if self.sampler is not None else self._place_slow
        self._model = config.model
        self._block_size = engine.block_size
        self._stride = 1  # keep every n-th latency for the run's percentiles (doubles past 1M kept)
        self._sampled_seen = 0  # finished requests the sample has looked at
        self._finished: list[Req] = []  # finished, not yet accounted (`_account_finished`)
        self._bucket_s = config.bucket_s
        self._slo_ttft = config.slo_ttft_s
        self._slo_tpot = config.slo_tpot_s
        self._window = Bucket(-1)
        self._window_start = 0.0
        self._admission = config.admission
        self._lazy = config.lazy_replicas  # serving replicas' segment ends applied on demand (`_catch_up`)
        self.lifecycle = Lifecycle(self.nodes, cold_start_s=config.cold_start_s, warm_start_s=config.warm_start_s,
                                   new_replica=self._new_starting, after=self._ready_after, serve=self._serve,
                                   begin_drain=self._begin_drain, park=self._park, stop=self._stop)
        for _ in range(config.replicas):
            self._new_node("serving")
        for _ in range(config.warm):
            self._new_node("warm")

    def clock(self) -> float:
        return self.now

    def _place_slow(self, model: str, prompt_tokens: int) -> str | None:
        return self.placer.place(m.PlacementRequest(request_id="", model=model, prompt_tokens=prompt_tokens)).worker_id

    # ---- the fleet's controls (for controllers) ------------------------------------------------

    @property
    def counts(self) -> dict[str, int]:
        return fleet_states(self.nodes.values())

    def start(self, count: int = 1, *, warm: bool = False) -> list[str]:
        return self.lifecycle.start(count, warm=warm)

    def promote(self, count: int = 1, ids: list[str] | None = None) -> list[str]:
        return self.lifecycle.promote(count, ids)

    def drain(self, count: int = 1, ids: list[str] | None = None, *, to_warm: bool = False) -> list[str]:
        self._catch_up_all()  # "least busy" as of now
        return self.lifecycle.drain(count, ids, to_warm=to_warm)

    def stop_warm(self, count: int = 1, ids: list[str] | None = None) -> list[str]:
        return self.lifecycle.stop_warm(count, ids)

    def _new_starting(self) -> _Node:
        return self._new_node("starting")

    def _ready_after(self, delay_s: float, node: _Node) -> None:
        self._push(self.now + delay_s, _READY, node, 0)

    def _begin_drain(self, node: _Node) -> None:
        node.replica.draining = True
        self.serving.pop(node.name, None)
        if self._lazy:
            self._push_segment(node.replica)  # eager from now: its last finish stops it on time
        self._heartbeat(node)
        if node.replica.in_flight == 0:
            self.lifecycle.drained(node)

    def _park(self, node: _Node) -> None:
        node.replica.draining = False
        node.beat = None
        self.registry.on_worker_gone(node.name)  # a warm worker leaves the router's registry

    # ---- running -------------------------------------------------------------------------------

    def run(self) -> Summary:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        config = self.config
        self._push(config.load_interval_s / config.report_cohorts, _TICK, None, 0)
        self._push(config.expire_interval_s, _EXPIRE, None, 0)
        self._push(self.controller.interval_s, _CONTROL, None, 0)
        self._push(config.bucket_s, _BUCKET, None, 0)
        heap = self.heap
        pop = heapq.heappop
        push = heapq.heappush
        limit = config.max_virtual_s if config.max_virtual_s is not None else INF
        arrivals = self._arrivals
        nxt = next(arrivals, None)
        next_t = nxt[0] if nxt is not None else INF
        if nxt is None or next_t > limit:
            self._go_eager()
        last_arrival = 0.0
        arrive = self._arrive
        events = 0
        while True:
            if heap[0][0] <= next_t:
                when, _, kind, obj, version = pop(heap)
                if when > limit:
                    self.now = limit
                    self._catch_up_all()
                    break
                self.now = when
                events += 1
                if kind == _SEGMENT:
                    replica: AnalyticReplica = obj  # type: ignore[assignment]
                    if replica.version == version:
                        end = replica.segment_end()
                        if end < INF:
                            self._seq += 1
                            push(heap, (end, self._seq, _SEGMENT, replica, replica.version))
                        elif nxt is None and self.completed + self.rejected == self.requests:
                            break  # everything arrived and finished
                elif kind == _TICK:
                    self._tick()
                elif kind == _BUCKET:
                    self._close_buckets(final=False)
                    if nxt is None and (self._outstanding() == 0 or when > last_arrival + config.drain_timeout_s):
                        break
                else:
                    self._other(kind, obj)
            else:
                self.now = last_arrival = next_t
                events += 1
                arrive(nxt)  # type: ignore[arg-type]
                nxt = next(arrivals, None)
                next_t = nxt[0] if nxt is not None else INF
                if nxt is None or next_t > limit:
                    nxt, next_t = None, INF
                    self._go_eager()
        self.events = events
        self._bill()
        self._close_buckets(final=True)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return self._summary(cpu, wall)

    # ---- lazy replicas -------------------------------------------------------------------------
    # While arrivals remain, a serving replica's segment ends are not heap events: they are applied
    # when something looks at the replica (an arrival placed on it, its load report, the shared
    # queue, a bucket close, the controller), by `_catch_up`. That applies exactly the segment ends
    # the event loop would have applied by then, without a heap push and pop per segment (and
    # without the stale entries that arrivals' segment cuts leave behind). Draining replicas, whose
    # last finish stops them, and every replica once the arrivals are exhausted, are eager: their
    # segment ends are heap events, so the run ends at the last finish as before.

    def _catch_up(self, replica: AnalyticReplica, now: float) -> None:
        """Apply the replica's segment ends up to `now` (inclusive). Callers check `replica.end <= now`
        first (the common case is nothing to do, and a call costs more than the test)."""
        replica.run_until(now)
        if not self._lazy or replica.draining:
            # An eager replica whose heap event ties with `now` and has not popped yet: that event
            # is stale now (`segment_end` re-planned), so queue the next one.
            self._push_segment(replica)

    def _catch_up_all(self) -> None:
        now = self.now
        for replica in self.serving.values():
            if replica.end <= now:
                self._catch_up(replica, now)

    def _push_segment(self, replica: AnalyticReplica) -> None:
        """Queue the replica's current segment end as a heap event (older ones become stale)."""
        if replica.end < INF:
            replica.version += 1
            self._push(replica.end, _SEGMENT, replica, replica.version)

    def _go_eager(self) -> None:
        if not self._lazy:
            return
        self._catch_up_all()
        self._lazy = False
        for replica in self.serving.values():
            self._push_segment(replica)

    def _outstanding(self) -> int:
        return self.requests - self.completed - self.rejected

    # ---- requests ------------------------------------------------------------------------------

    def _arrive(self, arrival: Arrival) -> None:
        t, n_in, n_out, cached = arrival
        blocks = self._prefix_blocks
        req = Req(t, n_in, n_out, cached, blocks[self.requests] if blocks is not None else None)
        self.requests += 1
        bucket = self._buckets.get(int(t // self._bucket_s)) or self._bucket(t)
        bucket.arrivals += 1
        self._window.arrivals += 1
        admission = self.admission
        if self._admission and (t >= admission.until or not admission.ok) and not admission.admitted(t):
            self.rejected += 1
            bucket.rejected += 1
            bucket.ttft.append(INF)
            self._window.rejected += 1
            return
        if self._prefix_routing:
            worker_id = self._place_prefix(n_in, req.blocks)
        else:
            worker_id = self._place(self._model, n_in)
        replica = self.serving.get(worker_id) if worker_id is not None else None
        if replica is None:
            self.shared.append(req)
            return
        replica.taken += 1  # from its own queue (the shared queue's requests are not counted)
        # `_dispatch`, inlined (once per request).
        if replica.end <= t:
            self._catch_up(replica, t)
        end = replica.add(req, t)
        if replica.cache_log:
            self._publish_cache(replica)
        if end < INF and (not self._lazy or replica.draining):
            self._seq += 1
            heapq.heappush(self.heap, (end, self._seq, _SEGMENT, replica, replica.version))

    def _place_prefix(self, prompt_tokens: int, blocks: tuple[int, ...] | None) -> str | None:
        """The router's placement of a request with prefix blocks (its full ones are its hashes)."""
        full = prompt_tokens // self._prefix_block_tokens
        request = m.PlacementRequest(request_id="", model=self._model, prompt_tokens=prompt_tokens,
                                     block_hashes=list(blocks[:full]) if blocks else [],
                                     block_size=self._prefix_block_tokens)
        reply = self.sampler.place(request) if self.sampler is not None else self.placer.place(request)
        return reply.worker_id

    def _publish_cache(self, replica: AnalyticReplica) -> None:
        """The replica's prefix-cache changes into the router's index (its KV events)."""
        index = self.registry.index
        if replica.stored_blocks:
            index.add(replica.name, replica.stored_blocks, self.now)
            replica.stored_blocks = []
        if replica.evicted_blocks:
            index.remove(replica.name, replica.evicted_blocks)
            replica.evicted_blocks = []

    def _dispatch(self, replica: AnalyticReplica, req: Req) -> None:
        now = self.now
        if replica.end <= now:
            self._catch_up(replica, now)
        end = replica.add(req, now)
        if replica.cache_log:
            self._publish_cache(replica)
        if end < INF and (not self._lazy or replica.draining):
            self._seq += 1
            heapq.heappush(self.heap, (end, self._seq, _SEGMENT, replica, replica.version))

    def _on_finish(self, req: Req, t: float) -> None:
        # Only recorded here: the metrics are computed in batches by `_account_finished`.
        self.completed += 1
        req.finish = t
        self._finished.append(req)
        replica = req.replica
        if replica is not None and replica.draining and not replica.B and not replica.prefill and not replica.waiting:
            self.lifecycle.drained(self.by_id[replica.name])

    def _account_finished(self) -> None:
        """Add the requests finished since the last call to their buckets (the minute they finished
        in), the controller's window and the run's sample. Called before any of those is read.

        Batched for speed: list comprehensions over a minute's requests instead of Python
        statements per request (the results are the same)."""
        done = self._finished
        if not done:
            return
        self._finished = []
        bucket_s = self._bucket_s
        first_index = int(done[0].finish // bucket_s)
        if all(int(r.finish // bucket_s) == first_index for r in done):
            self._account(self._buckets.get(first_index) or self._bucket(done[0].finish), done)
        else:  # across a bucket boundary (ties at it, or the last flush)
            groups: dict[int, list[Req]] = {}
            for r in done:
                groups.setdefault(int(r.finish // bucket_s), []).append(r)
            for index, group in groups.items():
                self._account(self._buckets.get(index) or self._bucket(group[0].finish), group)
        self._sample(done)

    def _account(self, bucket: Bucket, done: list[Req]) -> None:
        slo_ttft, slo_tpot = self._slo_ttft, self._slo_tpot
        ttft = [r.first - r.arrival for r in done]
        # TPOT of requests with at least two output tokens; -1 (within any SLO) for the others.
        tpot_all = [(r.finish - r.first) / (r.output - 1) if r.output > 1 else -1.0 for r in done]
        tpot = [x for x in tpot_all if x >= 0.0]
        outputs = [r.output for r in done]
        good = [out for out, a, b in zip(outputs, ttft, tpot_all) if a <= slo_ttft and b <= slo_tpot]
        bucket.completed += len(done)
        bucket.output_tokens += sum(outputs)
        bucket.good += len(good)
        bucket.good_tokens += sum(good)
        bucket.ttft += ttft
        bucket.tpot += tpot
        window = self._window
        window.ttft += ttft
        window.tpot += tpot
        window.wait += [r.start - r.arrival for r in done]

    def _sample(self, done: list[Req]) -> None:
        """The run's percentiles come from a bounded sample: every `_stride`-th finished request (in
        the order they were recorded), the stride doubling whenever 1M are kept."""
        base, pos, n = self._sampled_seen, 0, len(done)
        while pos < n:
            stride = self._stride
            start = pos + (-(base + pos + 1)) % stride  # the next i with (base + i + 1) % stride == 0
            picked = done[start::stride]
            room = 1_000_000 - len(self._all_ttft)
            if len(picked) >= room:
                picked = picked[:room]
                pos = start + (room - 1) * stride + 1
            else:
                pos = n
            self._all_ttft += [r.first - r.arrival for r in picked]
            self._all_tpot += [(r.finish - r.first) / (r.output - 1) for r in picked if r.output > 1]
            if len(self._all_ttft) >= 1_000_000:
                self._all_ttft = self._all_ttft[::2]
                self._all_tpot = self._all_tpot[::2]
                self._stride *= 2
        self._sampled_seen = base + n

    def _bucket(self, t: float) -> Bucket:
        index = int(t // self.config.bucket_s)
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = self._buckets[index] = Bucket(index)
        return bucket

    # ---- periodic work -------------------------------------------------------------------------

    def _tick(self) -> None:
        """Load reports (and heartbeats, every few reports) of one cohort; then the next cohort."""
        config = self.config
        cohort = self._cohort
        self._cohort = (cohort + 1) % config.report_cohorts
        beat_every = max(1, round(config.heartbeat_interval_s / config.load_interval_s))
        for node in list(self._cohorts[cohort]):
            if node.state not in ("serving", "draining"):
                continue
            node.reports += 1
            if node.reports % beat_every == 0:
                self._heartbeat(node)
            self._report(node)
        if self.shared:
            self._drain_shared()
        self._push(self.now + config.load_interval_s / config.report_cohorts, _TICK, None, 0)

    def _report(self, node: _Node) -> None:
        replica = node.replica  # as of its last segment end (a step boundary at most one segment ago)
        if replica.end <= self.now:
            self._catch_up(replica, self.now)
        node.seq += 1
        load = m.WorkerLoad(
            worker_id=node.name, model=self.config.model, ts=self.now, seq=node.seq,
            running=replica.B + len(replica.prefill), waiting=len(replica.waiting), in_flight=replica.in_flight,
            max_running=replica.max_running, kv_used_tokens=min(replica.kv_used(), replica.kv_capacity),
            kv_capacity_tokens=replica.kv_capacity, completed=replica.completed,
            queued_prefill_tokens=replica.queued_prefill(), draining=node.state == "draining",
            pulled_own=replica.taken,
        )
        self.registry.on_load(load)
        if self.config.admission:
            self.admission.on_load(load)

    def _heartbeat(self, node: _Node) -> None:
        state: Literal["ready", "draining"] = "draining" if node.state == "draining" else "ready"
        beat = node.beat
        if beat is None or beat.state != state:
            engine = self.config.engine
            beat = node.beat = m.Heartbeat(
                worker_id=node.name, model=self.config.model, engine_url=f"sim://{node.name}", started=node.since,
                ts=self.now, state=state, max_running=engine.max_running_requests, gpu=engine.gpu, tp=engine.tp,
                block_size=engine.block_size,
            )
        elif self.registry.touch(node.name):  # the same beat again: only its arrival time is news
            return
        self.registry.on_heartbeat(beat)

    def _drain_shared(self) -> None:
        for replica in list(self.serving.values()):
            if replica.end <= self.now:
                self._catch_up(replica, self.now)
            while self.shared and not replica.waiting and replica.B + len(replica.prefill) < replica.max_running:
                self._dispatch(replica, self.shared.popleft())
            if not self.shared:
                return

    def _other(self, kind: int, obj: object) -> None:
        if kind == _READY:
            self.lifecycle.ready(obj)
        elif kind == _EXPIRE:
            self.registry.expire()
            self._push(self.now + self.config.expire_interval_s, _EXPIRE, None, 0)
        elif kind == _CONTROL:
            signals = self.signals()
            self._window = Bucket(-1)
            self._window_start = self.now
            self.controller.decide(signals, self)
            self._push(self.now + self.controller.interval_s, _CONTROL, None, 0)

    def signals(self) -> FleetSignals:
        self._catch_up_all()
        self._account_finished()
        held = sum(n.replica.in_flight for n in self.nodes.values() if n.state in ("serving", "draining"))
        return fleet_signals(self.now, self._window, self._window_start, self.serving.values(), self.counts,
                             held + len(self.shared), (n.name for n in self.nodes.values() if n.state == "warm"))

    def _close_buckets(self, final: bool) -> None:
        config = self.config
        current = int(self.now // config.bucket_s)
        self._catch_up_all()
        self._account_finished()
        replicas = list(self.serving.values())
        kv = sum(min(1.0, r.kv_used() / r.kv_capacity) for r in replicas) / len(replicas) if replicas else 0.0
        queued = sum(len(r.waiting) for r in replicas) + len(self.shared)
        for index in sorted(self._buckets):
            if not final and index >= current:
                break
            bucket = self._buckets.pop(index)
            self.good += bucket.good
            self.good_tokens += bucket.good_tokens
            self.output_tokens += bucket.output_tokens
            self.series.append(close(bucket, config.bucket_s, config.slo_ttft_s, config.slo_tpot_s,
                                     serving=len(self.serving), started=self._started, kv_use=kv, queued=queued))
        if self.progress is not None:
            self.progress(self.now)
        if not final:
            self._push((current + 1) * config.bucket_s, _BUCKET, None, 0)

    # ---- replica lifecycle ---------------------------------------------------------------------

    def _new_node(self, state: str) -> _Node:
        self._next_id += 1
        name = f"sim-{self._next_id:04d}"
        engine = self.config.engine
        replica = AnalyticReplica(
            name, self.step_model, kv_capacity=self.kv_capacity, chunk=engine.chunked_prefill_size,
            max_running=engine.max_running_requests, on_finish=self._on_finish, mixed=engine.mixed_chunk,
            prefix_block_tokens=self._prefix_block_tokens, page_tokens=engine.block_size,
        )
        replica.cache_log = self._prefix_routing
        replica.t = self.now
        node = _Node(name, replica, cohort=self._next_id % self.config.report_cohorts)
        self._cohorts[node.cohort].append(node)
        node.since = self.now
        self.nodes[name] = node
        self.by_id[name] = node
        self._bill()
        self._started += 1
        if state == "serving":
            self._serve(node)
        else:
            node.state = state
        return node

    def _serve(self, node: _Node) -> None:
        node.state = "serving"
        node.replica.t = max(node.replica.t, self.now)
        self.serving[node.name] = node.replica
        self._peak_serving = max(self._peak_serving, len(self.serving))
        self._heartbeat(node)
        self._report(node)
        if self.shared:
            self._drain_shared()

    def _stop(self, node: _Node) -> None:
        if node.state == "stopped":
            return
        self._bill()
        self._started -= 1
        node.state = "stopped"
        self.serving.pop(node.name, None)
        self.registry.on_worker_gone(node.name)
        del self.nodes[node.name]
        self._cohorts[node.cohort].remove(node)

    def _bill(self) -> None:
        self._gpu_s += (self.now - self._billed_at) * self._started * self.config.engine.tp
        self._billed_at = self.now

    def _push(self, when: float, kind: int, obj: object, version: int) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (when, self._seq, kind, obj, version))

    # ---- the result ----------------------------------------------------------------------------

    def _summary(self, cpu: float, wall: float) -> Summary:
        config = self.config
        duration = max(self.now, 1e-9)
        minutes, attainment = minute_attainment(self.series)
        gpu_hours = self._gpu_s / 3600
        ttft = quantiles(self._all_ttft, 0.5, 0.9, 0.99)
        tpot = quantiles(self._all_tpot, 0.5, 0.9)
        return Summary(
            policy=self.placer.name, gpu=config.engine.gpu, tp=config.engine.tp, duration_s=duration,
            requests=self.requests, completed=self.completed, rejected=self.rejected,
            unfinished=self._outstanding(), minutes=minutes, minute_attainment=attainment,
            request_attainment=self.good / self.requests if self.requests else math.nan,
            goodput_rps=self.good / duration, goodput_tok_s=self.good_tokens / duration,
            output_tok_s=self.output_tokens / duration,
            ttft_p50_s=ttft[0], ttft_p90_s=ttft[1], ttft_p99_s=ttft[2], tpot_p50_s=tpot[0],
            tpot_p90_s=tpot[1], gpu_hours=gpu_hours, replica_hours=gpu_hours / config.engine.tp,
            cost_usd=gpu_hours * config.price_per_gpu_hour, price_per_gpu_hour=config.price_per_gpu_hour,
            peak_serving=self._peak_serving, slo_ttft_s=config.slo_ttft_s, slo_tpot_s=config.slo_tpot_s,
            cpu_s=cpu, wall_s=wall, req_per_cpu_s=self.requests / cpu if cpu > 0 else math.inf, events=self.events,
            build="pure Python" if __file__.endswith(".py") else "compiled",
            series=self.series,
        )
