"""A fleet of simulated engines behind the router's placement policy, on one virtual clock.

What runs is the production code: `services.router.placement` (the worker registry and the
policy) decides every placement from the same messages the router service receives (`proto.messages` heartbeats, load
reports, cache events), and each replica is a `services.sim_engine.scheduler.Engine` (continuous batching, chunked
prefill, radix prefix cache, KV capacity, the roofline step time). Only the bus and the worker
are modelled, simply:

- A request arrives at its trace time, the gateway hashes its prompt (64-token chained block
  hashes) and asks the policy. A worker id sends it straight into that replica's engine (engines
  queue internally; a real worker pulls its own queue only while the engine has room, which
  amounts to the same order). No worker id (`ANY_TARGET`) puts it on the shared FIFO queue,
  which a replica pulls from whenever its engine has no waiting request and a free slot.
- Each replica steps its engine back to back while it has work: one event per step, at the step's
  end, where that step's tokens become visible (first token, finish). The cache events the step
  produced reach the policy `bus_delay_s` later, as one `CacheEvent` with the next sequence
  number.
- Every `load_interval_s` (a random phase per replica) a replica reports `WorkerLoad` built from
  its engine; the policy sees it `bus_delay_s` later and works from reports, not the truth, in
  between. Heartbeats go every `heartbeat_interval_s`; a replica the policy first hears of gets a
  cache snapshot (as the router asks of a joining worker), and a sequence gap gets one too.
- The router's `expire()` runs every `expire_interval_s`. A replica killed with `kill_replica`
  stops stepping, reporting and heartbeating at once; requests placed on it after that wait in
  its queue. When the policy declares it dead (heartbeat TTL), its work is recovered: requests
  still waiting in its engine (or its queue) go back unchanged, as the router moves a dead
  worker's queue; requests the engine had started (prefilling or decoding) continue as a new
  attempt whose prompt is the original prompt plus the tokens delivered so far and whose output
  budget is what is left (the gateway's migration; the client's TTFT stays that of the first
  attempt, and work done on the dead replica is lost). With `recovery="shared"` (the default, as the router's recovery
  and the gateway's migration both publish to the shared subject) they join the shared queue; with
  `recovery="placement"` they are placed again by the policy. A request gets at most
  `max_attempts` attempts, then fails.
- With a `batch` (`batch.BatchSpec`), a batch band runs beside the trace: the batch service's feed
  policy and the workers' preemption policy on a shared batch queue (see `batch`). Then a
  replica's interactive pulls count slots as the worker does (interactive plus batch in flight
  against the engine's `max_running_requests`), and ignore batch lines waiting in the engine.
- With `admission` on, the gateway's overload policy sheds arrivals (fed the load reports); with
  a `controller` (the autoscaler's policy), the fleet scales: `start` (a cold start of
  `cold_start_s`, to serving or to the warm pool), `promote` (`warm_start_s`), `drain` (no new
  work, the replica finishes its own, then stops or goes warm) and `stop_warm`, as the fast
  simulator's. Both are wired as in the fast simulator (`wiring`), so one run can combine them
  with prefix affinity and a batch band.

Time the gateway and router spend on a request (a few ms on the live platform) is not modelled.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from inferbus.timing import StepTimeModel
from inferbus.tokens import continuation
from inferbus.tokens.blocks import block_hashes
from proto import bands
from proto import messages as m
from services.router.placement import Placer
from services.sim_engine.config import EngineConfig
from services.sim_engine.radix_cache import AllBlocksCleared, BlockRemoved, BlockStored, RadixCache
from services.sim_engine.request import Request, RequestRejected, RequestUpdate
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine
from tools.capacity.fleetsim.batch import BatchBand, BatchSpec
from tools.capacity.fleetsim.events import EventLoop
from tools.capacity.fleetsim.report import RunReport, build_report
from tools.capacity.fleetsim.state import FleetConfig, Job, Replica
from tools.capacity.fleetsim.timeseries import Bucket
from tools.capacity.fleetsim.wiring import (
    Admission,
    Controller,
    FleetSignals,
    Lifecycle,
    fleet_signals,
    fleet_states,
    make_placement,
)
from tools.capacity.fleetsim.workload import PromptTokens
from tools.capacity.traces import TraceRequest

# (clock, rng) -> the router's placement (`services.router.placement.Placer`)
PlacerFactory = Callable[[Callable[[], float], random.Random], Placer]


class FleetSim:
    """Replays `trace` through the placement policy onto `config.replicas` simulated engines.

    `run()` returns a `RunReport`. Change the fleet before (or during, by time) the run with
    `add_replica(at_s)` and `kill_replica(worker_id, at_s)`.
    """

    def __init__(
        self,
        config: FleetConfig,
        trace: Sequence[TraceRequest],
        *,
        placer_factory: PlacerFactory | None = None,
        step_model: StepTimeModel | None = None,
        prompts: PromptTokens | None = None,
        batch: BatchSpec | None = None,
        controller: Controller | None = None,
        engine_factory: Callable[[EngineConfig, StepTimeModel | None], Engine] = Engine,
    ) -> None:
        """`engine_factory` makes each replica's engine (a variant of the scheduler, to measure what
        a behaviour changes)."""
        self.config = config
        self.engine_factory = engine_factory
        self.loop = EventLoop()
        self.rng = random.Random(config.seed)
        if placer_factory is not None:
            self.placer = placer_factory(self.loop.clock, random.Random(config.seed))
        else:
            self.placer, _ = make_placement(config.policy, config.routing, config.engine.block_size, self.loop.clock,
                                            config.seed)
        self.registry = self.placer.registry
        self.admission = (Admission(self.loop.clock, config.admission_budget_s, config.admission_refresh_s)
                          if config.admission else None)
        self.controller = controller
        self.policy_name = self.placer.name
        self.step_model = step_model
        self.block_size = config.engine.block_size
        self.prompts = prompts or PromptTokens(config.trace_block_tokens)
        self.trace = list(trace)
        self.jobs = [
            Job(index=i, rid=f"req-{i:07d}", trace=r, arrival_s=r.arrival_s, input_tokens=r.input_tokens,
                output_tokens=r.output_tokens)
            for i, r in enumerate(self.trace)
        ]
        self.replicas: list[Replica] = []  # every replica that has served
        self.by_id: dict[str, Replica] = {}
        self.nodes: dict[str, Replica] = {}  # every replica not stopped (`wiring.FleetControls`)
        self.rejected = 0
        self.decisions = 0  # controller calls
        self._window = Bucket(-1)  # what the controller's next signals cover
        self._window_start = 0.0
        self.shared: deque[Job] = deque()
        self.outstanding = len(self.jobs)
        self.done = False
        self.migrations = 0
        self.recovered_queued = 0
        self.shared_placements = 0
        self.resyncs = 0
        self.placement_s = 0.0  # CPU in placer.place (process time)
        self.stalled = False
        self._last_progress = 0.0
        self._next_arrival = 0
        self._next_replica = 0
        self._ran = False
        self.band = BatchBand(self, batch) if batch is not None else None
        self._has_room = self._has_slot if batch is not None else self._engine_has_room  # type: ignore[method-assign]
        self.lifecycle = Lifecycle(self.nodes, cold_start_s=config.cold_start_s, warm_start_s=config.warm_start_s,
                                   new_replica=self._new_starting, after=self._ready_after, serve=self._serve,
                                   begin_drain=self._begin_drain, park=self._park, stop=self._stop)
        for _ in range(config.replicas):
            self.add_replica(0.0)
        for _ in range(config.warm):
            self._new_replica(self._next_worker_id(), "warm")

    # ---- fleet changes -------------------------------------------------------------------------

    def add_replica(self, at_s: float = 0.0) -> str:
        """A new replica that starts heartbeating at `at_s`; returns its worker id."""
        worker_id = self._next_worker_id()
        self.loop.at(at_s, self._start_replica, worker_id)
        return worker_id

    def _next_worker_id(self) -> str:
        self._next_replica += 1
        return f"sim-{self._next_replica:04d}"

    def kill_replica(self, worker_id: str, at_s: float) -> None:
        """The replica stops dead at `at_s` (no drain): no more steps, reports or heartbeats."""
        self.loop.at(at_s, self._kill, worker_id)

    def _start_replica(self, worker_id: str) -> None:
        self._serve(self._new_replica(worker_id, "starting"))

    def _new_replica(self, worker_id: str, state: str) -> Replica:
        engine = self.engine_factory(self.config.engine, self.step_model)
        engine.advance(self.loop.now)
        replica = Replica(worker_id, engine, self.loop.now)
        replica.state = state
        self.nodes[worker_id] = replica
        return replica

    def _serve(self, replica: Replica) -> None:
        replica.state = "serving"
        replica.epoch += 1
        if replica.worker_id not in self.by_id:
            replica.started_s = self.loop.now  # the worker starts once its engine is up
            self.replicas.append(replica)
            self.by_id[replica.worker_id] = replica
        self._heartbeat(replica, first=True, epoch=replica.epoch)
        # Reports start at a random phase so the fleet's reports are spread over the interval.
        self.loop.after(self.rng.random() * self.config.load_interval_s, self._report_load, replica, replica.epoch)
        self._pull_shared()

    # ---- the fleet's controls (`wiring.FleetControls`, for controllers) -----------------------------

    @property
    def counts(self) -> dict[str, int]:
        return fleet_states(self.nodes.values())

    def start(self, count: int = 1, *, warm: bool = False) -> list[str]:
        return self.lifecycle.start(count, warm=warm)

    def promote(self, count: int = 1, ids: list[str] | None = None) -> list[str]:
        return self.lifecycle.promote(count, ids)

    def drain(self, count: int = 1, ids: list[str] | None = None, *, to_warm: bool = False) -> list[str]:
        return self.lifecycle.drain(count, ids, to_warm=to_warm)

    def stop_warm(self, count: int = 1, ids: list[str] | None = None) -> list[str]:
        return self.lifecycle.stop_warm(count, ids)

    def signals(self) -> FleetSignals:
        nodes = list(self.nodes.values())
        held = sum(r.in_flight for r in nodes if r.state in ("serving", "draining") and r.alive)
        return fleet_signals(self.loop.now, self._window, self._window_start,
                             [r for r in nodes if r.state == "serving" and r.alive], fleet_states(nodes),
                             held + len(self.shared), [r.worker_id for r in nodes if r.state == "warm"])

    def _new_starting(self) -> Replica:
        return self._new_replica(self._next_worker_id(), "starting")

    def _ready_after(self, delay_s: float, replica: Replica) -> None:
        self.loop.after(delay_s, self.lifecycle.ready, replica)

    def _begin_drain(self, replica: Replica) -> None:
        self._heartbeat(replica, first=True, epoch=replica.epoch, reschedule=False)  # the router stops placing
        self._drained_check(replica)

    def _drained_check(self, replica: Replica) -> None:
        """A draining replica with nothing left: stop it, or park it in the warm pool."""
        if replica.state != "draining" or replica.jobs or replica.batch_jobs or replica.stepping:
            return
        self.lifecycle.drained(replica)

    def _park(self, replica: Replica) -> None:
        self.registry.on_worker_gone(replica.worker_id)  # a warm worker leaves the router's registry

    def _stop(self, replica: Replica) -> None:
        replica.state = "stopped"
        replica.stopped_s = self.loop.now
        self.nodes.pop(replica.worker_id, None)
        self.registry.on_worker_gone(replica.worker_id)

    def _control(self) -> None:
        assert self.controller is not None
        signals = self.signals()
        self._window = Bucket(-1)
        self._window_start = self.loop.now
        self.decisions += 1
        self.controller.decide(signals, self)
        if not self.done:
            self.loop.after(self.controller.interval_s, self._control)

    def _kill(self, worker_id: str) -> None:
        replica = self.by_id[worker_id]
        if replica.alive:
            replica.alive = False
            replica.died_s = self.loop.now

    # ---- running ---------------------------------------------------------------------------------

    def run(self) -> RunReport:
        if self._ran:
            raise RuntimeError("a FleetSim runs once; make a new one")
        self._ran = True
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if self.jobs:
            self.loop.at(self.jobs[0].arrival_s, self._arrive)
        elif self.band is None or self.band.done:
            self.done = True
        if self.band is not None:
            self.band.start()
        self.loop.after(self.config.expire_interval_s, self._expire)
        if self.controller is not None:
            self.loop.after(self.controller.interval_s, self._control)
        self.loop.run(until=self.config.max_virtual_s)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return build_report(self, cpu_s=cpu, wall_s=wall)

    def _finish_one(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0 and (self.band is None or self.band.done or self.band.spec.stop_with_interactive):
            self.done = True
            self.loop.stop()

    def batch_done(self) -> None:
        """The batch band's last line has its result."""
        if self.outstanding == 0:
            self.done = True
            self.loop.stop()

    # ---- requests --------------------------------------------------------------------------------

    def _arrive(self) -> None:
        job = self.jobs[self._next_arrival]
        self._next_arrival += 1
        self._last_progress = self.loop.now
        if self._next_arrival < len(self.jobs):
            self.loop.at(self.jobs[self._next_arrival].arrival_s, self._arrive)
        self._window.arrivals += 1
        if self.admission is not None and not self.admission.admitted(self.loop.now):
            self.rejected += 1
            self._window.rejected += 1
            job.status = "rejected"
            job.finish_s = self.loop.now
            self._finish_one()
            return
        job.prompt = self.prompts.ids(job.trace, job.index)
        job.hashes = block_hashes(job.prompt, self.block_size)
        self._place(job)

    def _place(self, job: Job) -> None:
        started = time.process_time()
        reply = self.placer.place(m.PlacementRequest(
            request_id=job.rid, model=self.config.model, prompt_tokens=len(job.prompt or ()),
            block_hashes=job.hashes or [], block_size=self.block_size,
        ))
        self.placement_s += time.process_time() - started
        replica = self.by_id.get(reply.worker_id) if reply.worker_id is not None else None
        if replica is None:
            self.shared_placements += 1
            self._to_shared(job)
        else:
            job.expected_cached = reply.cached_blocks * self.block_size
            self._dispatch(replica, job, own=True)

    def _to_shared(self, job: Job) -> None:
        job.expected_cached = 0
        self.shared.append(job)
        self._pull_shared()

    def _pull_shared(self) -> None:
        """Replicas with room take from the shared queue."""
        for replica in self.replicas:
            if not self.shared:
                break
            if self._has_room(replica):
                self._dispatch(replica, self.shared.popleft())

    @staticmethod
    def _engine_has_room(replica: Replica) -> bool:
        engine = replica.engine
        return (replica.alive and replica.state == "serving" and not engine.waiting
                and len(engine.running) < engine.config.max_running_requests)

    @staticmethod
    def _has_slot(replica: Replica) -> bool:
        """With a batch band: a free worker slot and no interactive request waiting in the engine."""
        if not replica.alive or replica.state != "serving":
            return False
        engine = replica.engine
        if len(replica.jobs) + len(replica.batch_jobs) >= engine.config.max_running_requests:
            return False
        return not any(request.priority > bands.ENGINE_PRIORITY["batch"] for request in engine.waiting)

    def interactive_load(self, replica: Replica, engine_wait_s: float) -> tuple[int, int, int]:
        """(held, queued, stalled) interactive requests as the worker sees them.

        Requests placed on a worker go straight into its engine here; the worker would leave
        those past its slots on its own queue. So: held = placed ones that fit in the slots batch
        leaves; queued = the rest, plus the shared queue; stalled = held ones still without a
        first token `engine_wait_s` after they went in (interactive waiting inside the engine is
        at most the engine's waiting count).
        """
        capacity = replica.engine.config.max_running_requests
        placed = len(replica.jobs)
        over = max(0, placed + len(replica.batch_jobs) - capacity)
        cutoff = self.loop.now - engine_wait_s
        stalled = sum(job.attempt_delivered == 0 and job.dispatched_s <= cutoff for job in replica.jobs.values())
        return placed - over, over + len(self.shared), min(stalled, len(replica.engine.waiting))

    def _dispatch(self, replica: Replica, job: Job, own: bool = False) -> None:
        """`own`: the job was placed on this replica (it comes from its own queue, not the shared one)."""
        if not replica.alive:
            replica.inbox.append(job)  # sits in the dead worker's queue until the router notices
            return
        if own:
            replica.pulled_own += 1
        if job.attempt == 0:
            m.observe(replica.queue_wait_hist, m.LATENCY_BUCKETS_S, self.loop.now - job.arrival_s)
            self._window.wait.append(self.loop.now - job.arrival_s)
        assert job.prompt is not None
        engine = replica.engine
        request = Request(
            rid=f"{job.rid}-{job.attempt:02d}", input_ids=job.prompt,
            sampling=SamplingParams(max_new_tokens=job.output_tokens - job.delivered, temperature=0.0, ignore_eos=True),
        )
        if not replica.stepping and engine.now < self.loop.now:
            engine.advance(self.loop.now - engine.now)
        try:
            engine.add(request)
        except RequestRejected as error:
            self._fail(job, str(error))
            return
        job.request = request
        job.replica = replica
        job.dispatched_s = self.loop.now
        job.attempt_delivered = 0
        replica.jobs[request.rid] = job
        if not replica.stepping:
            self.step(replica)

    def _fail(self, job: Job, error: str) -> None:
        job.status = "failed"
        job.error = error
        job.finish_s = self.loop.now
        job.prompt = job.hashes = job.request = None
        job.replica = None
        self._finish_one()

    # ---- engine steps ----------------------------------------------------------------------------

    def step(self, replica: Replica) -> None:
        """Start the replica's next engine step (its engine clock is at loop.now)."""
        engine = replica.engine
        result = engine.step()
        if engine.cache.events:
            self._publish_cache(replica, engine.cache.drain_events(), engine.now)
        if result.idle:
            replica.stepping = False
            if result.updates:
                self._step_done(replica, result.updates, stepping=False)
            return
        replica.stepping = True
        replica.steps += 1
        replica.busy_s += result.duration_s
        replica.prefill_tokens += result.prefill_tokens
        self.loop.at(engine.now, self._step_done, replica, result.updates)

    def _step_done(self, replica: Replica, updates: list[RequestUpdate], stepping: bool = True) -> None:
        if not replica.alive:
            return
        now = self._last_progress = self.loop.now
        jobs = replica.jobs
        band = self.band
        for update in updates:
            job = jobs.get(update.request.rid)
            if job is None:
                assert band is not None
                band.on_update(replica, update, now)
                continue
            produced = update.num_output_tokens
            if produced and job.first_token_s is None:
                job.first_token_s = now
                if job.attempt == 0:
                    m.observe(replica.ttft_hist, m.LATENCY_BUCKETS_S, now - job.arrival_s)
            job.attempt_delivered = produced
            if update.finish_reason is not None:
                del jobs[update.request.rid]
                replica.completed += 1
                if job.attempt == 0 and produced > 1 and job.first_token_s is not None:
                    m.observe(replica.tpot_fine_hist, m.TPOT_BUCKETS_S, (now - job.first_token_s) / (produced - 1))
                job.cached_tokens += update.request.cached_tokens
                job.delivered += produced
                if update.finish_reason.get("type") == "abort":
                    self._fail(job, str(update.finish_reason.get("message", "aborted")))
                    continue
                job.status = "completed"
                job.finish_s = now
                job.prompt = job.hashes = job.request = None
                job.replica = None
                window = self._window
                if job.first_token_s is not None:
                    window.ttft.append(job.first_token_s - job.arrival_s)
                    if job.delivered > 1:
                        window.tpot.append((now - job.first_token_s) / (job.delivered - 1))
                self._finish_one()
        if replica.batch_aborts:
            assert band is not None
            band.abort(replica)
        if self.shared and self._has_room(replica):
            self._dispatch(replica, self.shared.popleft())
        if band is not None and band.queue:
            band.pull(replica)
        if stepping:
            self.step(replica)
        if replica.state == "draining" and not replica.stepping:
            self._drained_check(replica)

    # ---- messages to the router ------------------------------------------------------------------

    def _publish_cache(self, replica: Replica, events: list[Any], ts: float) -> None:
        stored: list[m.BlockStored] = []
        removed: list[int] = []
        cleared = False
        for event in events:
            if type(event) is BlockStored:
                stored.append(m.BlockStored(
                    block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
                    block_size=event.block_size, adapter=event.lora_name,
                ))
            elif type(event) is BlockRemoved:
                removed.extend(event.block_hashes)
            elif type(event) is AllBlocksCleared:
                stored, removed, cleared = [], [], True
        replica.cache_seq += 1
        message = m.CacheEvent(
            worker_id=replica.worker_id, seq=replica.cache_seq, ts=ts, stored=stored, removed=removed, cleared=cleared,
        )
        self.loop.at(ts + self.config.bus_delay_s, self._deliver_cache, replica, message)

    def _deliver_cache(self, replica: Replica, message: m.CacheEvent) -> None:
        if not replica.alive:
            return
        if not self.registry.on_cache(message):
            self._resync(replica)

    def _resync(self, replica: Replica) -> None:
        """The worker answers a resync request with a snapshot of its engine's cache."""
        self.resyncs += 1
        replica.cache_seq += 1
        snapshot = m.CacheEvent(
            worker_id=replica.worker_id, seq=replica.cache_seq, ts=self.loop.now, cleared=True,
            stored=[m.BlockStored(block_hashes=cache_blocks(replica.engine.cache), block_size=self.block_size)],
        )
        self.loop.after(2 * self.config.bus_delay_s, self._deliver_cache, replica, snapshot)

    def _heartbeat(self, replica: Replica, first: bool = False, epoch: int = 1, reschedule: bool = True) -> None:
        if not replica.alive or replica.epoch != epoch or replica.state not in ("serving", "draining"):
            return  # dead, or the serving period this timer belongs to is over
        config = self.config.engine
        beat = m.Heartbeat(
            worker_id=replica.worker_id, model=self.config.model, engine_url=f"sim://{replica.worker_id}",
            started=replica.started_s, ts=self.loop.now, state="draining" if replica.state == "draining" else "ready",
            max_running=config.max_running_requests,
            gpu=config.gpu, tp=config.tp, block_size=config.block_size,
        )
        if first:
            self._deliver_heartbeat(replica, beat)  # registered before any request can arrive
        else:
            self.loop.after(self.config.bus_delay_s, self._deliver_heartbeat, replica, beat)
        if reschedule and not self.done:
            self.loop.after(self.config.heartbeat_interval_s, self._heartbeat, replica, False, epoch)

    def _deliver_heartbeat(self, replica: Replica, beat: m.Heartbeat) -> None:
        if replica.state not in ("serving", "draining"):
            return  # stopped or parked while the beat was on the bus
        known = replica.worker_id in self.registry.workers
        self.registry.on_heartbeat(beat)
        if not known:
            self._resync(replica)  # the router asks a joining worker for its cache

    def _report_load(self, replica: Replica, epoch: int = 1) -> None:
        if not replica.alive or replica.epoch != epoch or replica.state not in ("serving", "draining"):
            return
        engine = replica.engine
        snapshot = engine.load()
        queued_prefill = replica.queued_prefill()
        replica.load_seq += 1
        report = m.WorkerLoad(
            worker_id=replica.worker_id, model=self.config.model, ts=self.loop.now, seq=replica.load_seq,
            running=snapshot.num_running_reqs, waiting=snapshot.num_waiting_reqs,
            in_flight=len(replica.jobs) + len(replica.batch_jobs),
            max_running=snapshot.max_running_requests, kv_used_tokens=snapshot.num_used_tokens,
            kv_capacity_tokens=snapshot.max_total_num_tokens, cache_hit_rate=snapshot.cache_hit_rate,
            completed=replica.completed, queued_prefill_tokens=queued_prefill, pulled_own=replica.pulled_own,
            draining=replica.state == "draining",
            batch_in_flight=len(replica.batch_jobs), completed_batch=replica.completed_batch,
            batch_waiting=sum(1 for line in replica.batch_jobs.values() if line.attempt_generated == 0),
            ttft_hist=list(replica.ttft_hist), queue_wait_hist=list(replica.queue_wait_hist),
            tpot_fine_hist=list(replica.tpot_fine_hist), gpu=self.config.engine.gpu, tp=self.config.engine.tp,
        )
        self.loop.after(self.config.bus_delay_s, self.registry.on_load, report)
        if self.admission is not None:
            self.loop.after(self.config.bus_delay_s, self.admission.on_load, report)
        if self.band is not None:
            self.loop.after(self.config.bus_delay_s, self.band.observe, report)
            self.band.check(replica)  # the worker's preemption check runs on its load tick
        if not self.done:
            self.loop.after(self.config.load_interval_s, self._report_load, replica, epoch)

    # ---- dead workers ----------------------------------------------------------------------------

    def _expire(self) -> None:
        for worker_id in self.registry.expire():
            replica = self.by_id.get(worker_id)
            if replica is not None and not replica.alive and not replica.recovered:
                self._recover(replica)
        if self.done:
            return
        if (
            self._next_arrival >= len(self.jobs)
            and self.loop.now - self._last_progress > self.config.stall_timeout_s
            and not any(replica.stepping and replica.alive for replica in self.replicas)
        ):
            self.stalled = True
            self.loop.stop()
            return
        self.loop.after(self.config.expire_interval_s, self._expire)

    def _recover(self, replica: Replica) -> None:
        """Move a dead replica's work elsewhere (see the module docstring)."""
        replica.recovered = True
        moved: list[Job] = list(replica.inbox)
        replica.inbox.clear()
        self.recovered_queued += len(moved)
        running = set(map(id, replica.engine.running))
        for job in sorted(replica.jobs.values(), key=lambda j: j.index):
            request = job.request
            assert request is not None and job.prompt is not None
            job.request = job.replica = None
            if id(request) not in running and job.attempt_delivered == 0:
                # Still waiting in the engine, never started: the queued request moves unchanged.
                self.recovered_queued += 1
                moved.append(job)
                continue
            # Accepted and started: the gateway migrates it as a new attempt.
            self.migrations += 1
            job.cached_tokens += request.cached_tokens
            if job.attempt_delivered:
                job.prompt, left = continuation.engine_input(job.prompt, request.output_ids[: job.attempt_delivered],
                                                             job.output_tokens - job.delivered)
                job.delivered = job.output_tokens - left
                job.hashes = block_hashes(job.prompt, self.block_size)
            job.attempt += 1
            job.attempt_delivered = 0
            if job.attempt >= self.config.max_attempts:
                self._fail(job, f"gave up after {job.attempt} attempts")
                continue
            if job.delivered >= job.output_tokens:
                # Everything was streamed; only the final event was lost.
                job.status = "completed"
                job.finish_s = self.loop.now
                job.prompt = job.hashes = None
                self._finish_one()
                continue
            moved.append(job)
        replica.jobs.clear()
        if self.band is not None:
            self.band.recover(replica)
        moved.sort(key=lambda j: j.index)
        for job in moved:
            if self.config.recovery == "placement":
                self._place(job)
            else:
                self._to_shared(job)


def cache_blocks(cache: RadixCache) -> list[int]:
    """Every block hash in an engine's prefix cache (for a resync snapshot)."""
    return cache.block_hashes()


def simulate(
    trace: Sequence[TraceRequest],
    config: FleetConfig | None = None,
    **overrides: Any,
) -> RunReport:
    """One run: `simulate(trace, replicas=8, policy="affinity")`."""
    config = config or FleetConfig(**overrides)
    return FleetSim(config, trace).run()
