from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

from inferbus.runtime import settings as shared
from inferbus.runtime.node_zone import read_zone
from inferbus.runtime.settings import env
from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE
from proto.bands import Band
from proto.bands import parse as parse_bands

from .fault_hold import POINTS as FAULT_POINTS
from .preemption import PreemptionConfig


@dataclass(frozen=True)
class WorkerSettings:
    nats_url: str = shared.nats_url()
    worker_id: str = env(
        "INFERBUS_WORKER_ID", "", "Unique id of this worker, one per engine replica (default: the host name)."
    )
    engine_url: str = env(
        "INFERBUS_ENGINE_URL",
        "http://127.0.0.1:30000",
        "Base URL of the SGLang server (or simulated engine) this worker drives.",
    )
    model: str = shared.model("Model id this worker serves (must match the gateway's).")
    engine_kv_events: str = env(
        "INFERBUS_ENGINE_KV_EVENTS",
        "",
        "ZMQ endpoint where the engine publishes KV-cache events (SGLang --kv-events-config), e.g. "
        "tcp://127.0.0.1:5557; empty: no prefix-cache reporting.",
    )
    engine_kv_events_bind: bool = env(
        "INFERBUS_ENGINE_KV_EVENTS_BIND", True,
        "Bind INFERBUS_ENGINE_KV_EVENTS and let the engine's publisher connect (SGLang's publisher connects to a "
        "concrete address); false: connect to it, for an engine that binds (`\"bind\": true` or a wildcard address).",
    )
    block_size: int = shared.block_size(
        DEFAULT_BLOCK_SIZE,
        "the engine's cache events are rebuilt into blocks of this size from their token "
        "ids, whatever the engine's page size; must match the gateway's and the router's.",
    )
    bands: str = env(
        "INFERBUS_WORKER_BANDS",
        "premium,standard,batch",
        "Priority bands to pull, most important first, of `premium`, `standard` and `batch` (a name that is no band "
        "stops the worker at start; `batch`: lines of the Batch API, only into slots the preemption policy grants). "
        "Formerly INFERBUS_WORKER_TIERS, still read when this is not set.",
        formerly="INFERBUS_WORKER_TIERS",
    )
    max_running: int = env(
        "INFERBUS_WORKER_MAX_RUNNING",
        0,
        "Requests to hold at once; 0 = the engine's max_running_requests from /server_info.",
    )
    batch_share: float = env(
        "INFERBUS_WORKER_BATCH_SHARE",
        0.75,
        "Largest share of this worker's slots that batch lines may hold (0-1, rounded down).",
    )
    batch_headroom: int = env(
        "INFERBUS_WORKER_BATCH_HEADROOM",
        1,
        "Slots kept free for interactive arrivals while batch lines run; with fewer free, the worker checks for "
        "waiting interactive work and preempts batch lines for it.",
    )
    batch_engine_wait_s: float = env(
        "INFERBUS_WORKER_BATCH_ENGINE_WAIT_S",
        0.5,
        "Without engine priority: an interactive request without a first token after this long counts as waiting in a "
        "full engine, and a batch line is preempted for it.",
    )
    engine_priority: str = env(
        "INFERBUS_WORKER_ENGINE_PRIORITY",
        "auto",
        "Whether the engine schedules by request priority (SGLang --enable-priority-scheduling): `auto` reads "
        "enable_priority_scheduling from its /server_info; `on`/`off` override. With it the engine makes room for "
        "interactive work inside it by retracting batch lines in place; without it the worker aborts and requeues "
        "them.",
    )
    batch_max_prefilling: int = env(
        "INFERBUS_WORKER_BATCH_MAX_PREFILLING",
        1,
        "Batch lines without a first token yet (in the engine's queue or prefill, or being pulled) before the worker "
        "pulls no more. A prefill worker (disaggregated) takes this many batch lines' prompts at once and refuses more "
        "(`full`: their decode workers ask again); an interactive prompt that finds it full preempts the batch prompt "
        "it sent its engine first, the one the engine computes (its line goes back to the batch queue).",
    )
    batch_max_slowdown: float = env(
        "INFERBUS_WORKER_BATCH_MAX_SLOWDOWN",
        0.06,
        "Step-time increase batch lines may cause on this worker (caps its batch lines at this share of its engine's "
        "base step in sequences, about 113 on H100 TP2, plus interactive running; match INFERBUS_BATCH_MAX_SLOWDOWN).",
    )
    batch_max_attempts: int = env(
        "INFERBUS_WORKER_BATCH_MAX_ATTEMPTS",
        5,
        "Attempts of a batch line across retryable engine failures before it ends with an error result.",
    )
    zone: str = shared.zone("this worker")
    zone_file: str = shared.zone_file("this worker's")
    engine_hang_after_s: float = env(
        "INFERBUS_WORKER_ENGINE_HANG_AFTER_S",
        30.0,
        "GPU death: with requests running and none producing a token for this long, the engine is hung; the worker "
        "hands its streams off and exits so its replica is replaced (0: never).",
    )
    engine_dead_after_s: float = env(
        "INFERBUS_WORKER_ENGINE_DEAD_AFTER_S",
        120.0,
        "GPU death: an engine that has not answered its readiness probe for this long is given up, as a hung one is "
        "(0: wait forever).",
    )
    engine_max_errors: int = env(
        "INFERBUS_WORKER_ENGINE_MAX_ERRORS",
        5,
        "GPU death: this many requests in a row ending in an engine error (5xx), none succeeding in between, and the "
        "engine is given up (0: never).",
    )
    heartbeat_interval_s: float = env(
        "INFERBUS_HEARTBEAT_INTERVAL_S", 1.0, "How often the heartbeat is refreshed in the `workers` KV bucket."
    )
    heartbeat_ttl_s: float = shared.heartbeat_ttl_s("A worker whose heartbeat is older than this is dead.")
    stall_after_s: float = env(
        "INFERBUS_WORKER_STALL_AFTER_S",
        30.0,
        "The heartbeat thread stops heartbeating (and the worker is declared dead) when the worker's event loop has "
        "not run for this long.",
    )
    state_dir: str = shared.state_dir("the usage outbox: usage events waiting for JetStream's acknowledgement")
    frame_window_ms: float = env(
        "INFERBUS_WORKER_FRAME_WINDOW_MS", 1.0,
        "Stream events for one gateway wait at most this long to leave together as one bus message (an engine step's "
        "tokens for many streams reach the worker over several reads); a stream's first token, errors and handoffs "
        "never wait. 0: one message per gateway per event-loop pass.",
    )
    accepted_wait_ms: float = env(
        "INFERBUS_WORKER_ACCEPTED_WAIT_MS", 20.0,
        "A stream's `accepted` event waits at most this long for the stream's first token, to leave with it as one bus "
        "message (at low load they would otherwise go a millisecond apart); never less than the frame window. The "
        "gateway's queue accounting learns of the start this much later at most.",
    )
    replay_keep_s: float = env(
        "INFERBUS_WORKER_REPLAY_KEEP_S", 10.0,
        "How long a finished stream's last events are kept to be sent again to a gateway that missed them (core NATS "
        "drops messages in flight when a node dies); longer than the gateways' INFERBUS_STREAM_SILENCE_S plus a "
        "reconnect. A stream's last 256 events are kept while it runs.",
    )
    fault_hold: str = env(
        "INFERBUS_FAULT_HOLD", "",
        "Testing only: a point where the first worker sharing INFERBUS_STATE_DIR to get there stops for good, after "
        "writing the file `fault-hold-<point>` there, so that a test can kill it at that point. `after_ack`: a "
        "request is taken from its queue, its `Accepted` not yet sent; `before_final`: a request's usage event is on "
        "disk, its last chunk not yet sent. Empty: none.",
    )
    load_interval_s: float = env("INFERBUS_LOAD_INTERVAL_S", 0.25, "How often engine load is polled and published.")
    fetch_timeout_s: float = env(
        "INFERBUS_FETCH_TIMEOUT_S", 1.0, "Long-poll time of one pull request when the queue is empty."
    )
    ack_wait_s: float = env(
        "INFERBUS_ACK_WAIT_S", 15.0, "Redelivery delay for a request pulled by a worker that died before accepting it."
    )
    claim_ttl_s: float = env(
        "INFERBUS_WORKER_CLAIM_TTL_S",
        900.0,
        "How long a worker's claim on a request attempt is kept (the `claims` bucket): a second delivery of the "
        "attempt within it runs nowhere. Keep it above the gateways' INFERBUS_REQUEST_TIMEOUT_S.",
    )
    drain_timeout_s: float = env(
        "INFERBUS_DRAIN_TIMEOUT_S", 30.0, "On SIGTERM, how long in-flight requests may run before they are handed back."
    )
    release: str = env(
        "INFERBUS_WORKER_RELEASE", "",
        "The release this worker serves (its id, or a unique prefix of it, from `inferbus release create`). At start "
        "the worker checks that the files of INFERBUS_MODEL_DIR, its chat template and the engine's flags are the "
        "release's, and refuses to start otherwise; empty: unpinned, left out of canaries and pinned traffic.",
    )
    model_dir: str = shared.model_dir(
        "The model directory the engine loads (the release's files are checked against it)."
    )
    engine_image_check: str = env(
        "INFERBUS_ENGINE_IMAGE_CHECK", "auto",
        "With a release: compare the digest of the image the engine container runs, as the kubelet reports it in the "
        "pod's status (`imageID`), with the release's engine image. `auto`: in a Kubernetes pod, and say why not when "
        "the pod cannot be read; `kubernetes`: required (refuse to start without it); `off`: never. Outside Kubernetes "
        "nothing reports the digest, and the worker logs `engine_image_unverified`.",
    )
    engine_container: str = env(
        "INFERBUS_ENGINE_CONTAINER",
        "sglang",
        "The engine's container in this worker's pod (whose image digest is checked).",
    )
    k8s_api_url: str = env(
        "INFERBUS_K8S_API_URL",
        "",
        "Kubernetes API for reading this worker's own pod (default: in-cluster, with its ServiceAccount).",
    )
    pod_name: str = env(
        "INFERBUS_POD_NAME", "", "This worker's pod (default: HOSTNAME, which Kubernetes sets to the pod's name)."
    )
    pod_namespace: str = env("INFERBUS_POD_NAMESPACE", "", "This worker's namespace (default: its ServiceAccount's).")
    standby: bool = env(
        "INFERBUS_WORKER_STANDBY",
        False,
        "Start warm: load the engine, then pull nothing until the autoscaler sends `promote` (the warm pool).",
    )
    sim_cold_start_s: float = env(
        "INFERBUS_WORKER_SIM_COLD_START_S",
        0.0,
        "Extra seconds of start-up standing in for a model load the simulated engine does not do (0 with real "
        "engines).",
    )
    sim_warm_start_s: float = env(
        "INFERBUS_WORKER_SIM_WARM_START_S",
        0.0,
        "Seconds a promoted warm worker waits before pulling, standing in for an engine's wake-up (0 with real "
        "engines).",
    )
    role: str = env(
        "INFERBUS_WORKER_ROLE", "auto",
        "Prefill/decode disaggregation: `aggregated` (the engine prefills and decodes its own requests), `prefill` "
        "(it computes prompts for decode workers and pulls no requests), `decode` (it pulls requests and has their "
        "prompts computed by prefill workers), or `auto`: the engine's --disaggregation-mode from its /server_info. "
        "A role the engine does not run is refused at start.",
    )
    engine_bootstrap_host: str = env(
        "INFERBUS_ENGINE_BOOTSTRAP_HOST", "",
        "Prefill workers: the host decode engines reach this engine's bootstrap server at (SGLang's bootstrap_host; "
        "its port is the engine's --disaggregation-bootstrap-port; the engine must listen there on an address "
        "they reach, e.g. --host 0.0.0.0). Empty: the host of INFERBUS_ENGINE_URL, or, when that is a loopback "
        "address (the engine in this worker's pod), this host's own address (its name resolved: the pod's IP).",
    )
    placement_patience_ms: float = shared.placement_patience_ms(
        "Decode workers: how long asking the router for a prefill worker waits for a router that is answering "
        "(one answered in the last 5 s), instead of 50 ms: a slow router still answers from its whole view, where "
        "the worker's own choice knows no prefix cache (as the gateway's setting of the same name).",
    )
    liveness_timeout_s: float = shared.liveness_timeout_s(
        "Decode workers: how long a prefill worker whose heartbeat lapsed has to answer the liveness probe before its "
        "prefill halves are tried elsewhere; also how long a prefill worker has to answer a prefill half."
    )
    metrics_port: int = shared.metrics_port(9102, "this worker's")
    log_level: str = shared.log_level()
    otel_exporter: str = shared.otel_exporter()

    def resolved(self) -> WorkerSettings:
        """With its id (the host name when none is given) and its zone (INFERBUS_ZONE_FILE when
        INFERBUS_ZONE is empty) filled in."""
        zone = read_zone(self.zone, self.zone_file)
        return dataclasses.replace(self, worker_id=self.worker_id or socket.gethostname(), zone=zone)

    def __post_init__(self) -> None:
        if self.sim_cold_start_s < 0 or self.sim_warm_start_s < 0:
            raise SystemExit("INFERBUS_WORKER_SIM_COLD_START_S and INFERBUS_WORKER_SIM_WARM_START_S must be >= 0")
        self.preemption()  # refuse bad INFERBUS_WORKER_BATCH_* values at start-up
        if self.frame_window_ms < 0:
            raise SystemExit("INFERBUS_WORKER_FRAME_WINDOW_MS must be >= 0")
        if self.accepted_wait_ms < 0:
            raise SystemExit("INFERBUS_WORKER_ACCEPTED_WAIT_MS must be >= 0")
        if self.role not in ("auto", "aggregated", "prefill", "decode"):
            raise SystemExit(f"INFERBUS_WORKER_ROLE must be auto, aggregated, prefill or decode, not {self.role!r}")
        if self.fault_hold and self.fault_hold not in FAULT_POINTS:
            raise SystemExit(
                f"INFERBUS_FAULT_HOLD must be one of {', '.join(FAULT_POINTS)} or empty, not {self.fault_hold!r}"
            )
        try:
            parse_bands(self.bands, "INFERBUS_WORKER_BANDS")
        except ValueError as error:
            raise SystemExit(str(error)) from None
        if self.engine_priority not in ("auto", "on", "off"):
            raise SystemExit(f"INFERBUS_WORKER_ENGINE_PRIORITY must be auto, on or off, not {self.engine_priority!r}")

    def preemption(self) -> PreemptionConfig:
        try:
            return PreemptionConfig(batch_share=self.batch_share, headroom=self.batch_headroom,
                                    engine_wait_s=self.batch_engine_wait_s, max_attempts=self.batch_max_attempts,
                                    max_prefilling=self.batch_max_prefilling, max_slowdown=self.batch_max_slowdown)
        except ValueError as error:
            raise SystemExit(f"INFERBUS_WORKER_BATCH_*: {error}") from None

    def engine_has_priority(self, server_info: dict[str, object]) -> bool:
        """Whether the engine admits and retracts by priority: the setting, or its /server_info."""
        if self.engine_priority != "auto":
            return self.engine_priority == "on"
        return bool(server_info.get("enable_priority_scheduling"))

    def band_list(self) -> list[Band]:
        return list(parse_bands(self.bands, "INFERBUS_WORKER_BANDS"))
