"""What the fleet simulator's parts share: its configuration, a client request across its attempts
(`Job`) and a worker with its engine (`Replica`). `fleet.FleetSim` runs them; `batch` and `report`
read them without knowing the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from proto import messages as m
from services.sim_engine.config import DEFAULT_MODEL, EngineConfig
from services.sim_engine.request import Request
from services.sim_engine.scheduler import Engine
from services.worker.preemption import Check
from tools.capacity.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest


@dataclass
class FleetConfig:
    replicas: int = 8
    engine: EngineConfig = field(default_factory=EngineConfig)  # H100 TP2, KV from GPU memory
    policy: str = "affinity"  # affinity | least_loaded | round_robin
    routing: Any = None  # services.router.config.RoutingConfig; None: its defaults (block size from `engine`)
    seed: int = 0
    model: str = DEFAULT_MODEL
    load_interval_s: float = 0.25
    heartbeat_interval_s: float = 1.0
    bus_delay_s: float = 0.001  # publish → the router has it (load reports, heartbeats, cache events)
    expire_interval_s: float = 0.5
    max_attempts: int = 3
    recovery: Literal["shared", "placement"] = "shared"
    # Token ids per trace block id (Mooncake: 512); see `workload.PromptTokens`.
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    # Give up at this virtual time; requests not finished by then are counted as unfinished.
    max_virtual_s: float | None = None
    # Stop when, after the last arrival, no engine has stepped for this long (requests stuck on
    # the shared queue with every replica dead, say); they are counted as unfinished.
    stall_timeout_s: float = 30.0
    warm: int = 0  # warm replicas (loaded, not serving) at t = 0
    admission: bool = False  # the gateway's overload policy sheds arrivals (`wiring.Admission`)
    admission_budget_s: float = 3.0  # the gateway's standard band (OverloadPolicy default)
    admission_refresh_s: float = 0.25
    cold_start_s: float = 120.0  # `start`: launch → serving (or warm)
    warm_start_s: float = 5.0  # `promote`: warm → serving

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.warm < 0:
            raise ValueError("replicas and warm must not be negative")
        if self.recovery not in ("shared", "placement"):
            raise ValueError("recovery must be 'shared' or 'placement'")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")


@dataclass(eq=False, slots=True)
class Job:
    """One client request across its attempts: what the gateway knows of it."""

    index: int
    rid: str
    trace: TraceRequest
    arrival_s: float
    input_tokens: int
    output_tokens: int
    prompt: list[int] | None = None  # this attempt's prompt (original + output delivered so far)
    hashes: list[int] | None = None
    attempt: int = 0
    delivered: int = 0  # output tokens the client has from finished or abandoned attempts
    attempt_delivered: int = 0  # output tokens of the current attempt delivered so far
    request: Request | None = None
    replica: Replica | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0  # engine-reported, all attempts
    dispatched_s: float = 0.0  # the current attempt entered an engine
    # Prompt tokens the router expected cached where it placed this attempt (0 from the shared
    # queue): the worker leaves them out of the queued prefill it reports.
    expected_cached: int = 0
    status: Literal["pending", "completed", "failed", "rejected"] = "pending"
    error: str = ""


class Replica:
    """One worker and its engine."""

    __slots__ = (
        "worker_id", "engine", "alive", "stepping", "jobs", "inbox", "cache_seq", "load_seq",
        "completed", "busy_s", "prefill_tokens", "steps", "started_s", "died_s", "recovered", "pulled_own",
        "batch_jobs", "batch_aborts", "batch_check", "completed_batch", "ttft_hist", "queue_wait_hist",
        "tpot_fine_hist", "state", "warm_target", "epoch", "stopped_s",
    )

    def __init__(self, worker_id: str, engine: Engine, started_s: float) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.alive = True
        self.stepping = False
        self.jobs: dict[str, Job] = {}  # engine rid → job, in this engine now
        self.inbox: list[Job] = []  # placed here after it died, before the router noticed
        self.cache_seq = 0
        self.load_seq = 0
        self.completed = 0
        self.pulled_own = 0  # jobs taken from its own queue (placed on it), as the worker service counts
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.steps = 0
        self.started_s = started_s
        self.died_s: float | None = None
        self.recovered = False
        self.batch_jobs: dict[str, Any] = {}  # engine rid → batch.BatchLine, in this engine now
        self.completed_batch = 0
        self.batch_aborts: list[str] = []  # engine rids of batch lines to abort at the step's end
        self.batch_check = Check()  # the worker's last preemption check (what blocks batch pulls)
        # Interactive only, cumulative, as the worker reports them (WorkerLoad).
        self.ttft_hist: list[int] = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
        self.queue_wait_hist: list[int] = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
        self.tpot_fine_hist: list[int] = [0] * (len(m.TPOT_BUCKETS_S) + 1)
        self.state = "serving"  # starting | warm | serving | draining | stopped (`FleetSim.start` and co.)
        self.warm_target = False  # a start or drain that ends in the warm pool
        self.epoch = 0  # serving periods so far: a period's heartbeat and report timers end with it
        self.stopped_s: float | None = None

    # ---- `wiring.ReplicaModel` ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.worker_id

    @property
    def kv_capacity(self) -> int:
        return self.engine.cache.capacity_tokens

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def waiting(self) -> list[Request]:
        return self.engine.waiting

    @property
    def in_flight(self) -> int:
        return len(self.engine.running) + len(self.engine.waiting)

    def kv_used(self) -> int:
        cache = self.engine.cache
        return cache.capacity_tokens - cache.available_tokens()

    def queued_prefill(self) -> int:
        """Prompt tokens taken and not prefilled, as the worker reports them: a request the engine
        has not started counts its prompt less what the router expected cached (the engine matches
        its prefix only when it schedules it)."""
        engine = self.engine
        jobs = self.jobs
        queued = 0
        for request in engine.waiting:
            left = len(request.fill_ids) - request.computed
            if not request.computed:
                job = jobs.get(request.rid)
                if job is not None:
                    left = max(0, left - job.expected_cached)
            queued += left
        return queued + sum(len(r.fill_ids) - r.computed for r in engine.running if r.computed < len(r.fill_ids))

    @property
    def generated_tokens(self) -> int:
        return self.engine.generation_tokens_total

    @property
    def processed_tokens(self) -> int:
        """Prompt tokens prefilled plus output tokens generated here."""
        return self.prefill_tokens + self.engine.generation_tokens_total
