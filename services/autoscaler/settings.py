from __future__ import annotations

import dataclasses
import json
import re
import socket
from dataclasses import dataclass

from inferbus.runtime import settings as shared
from inferbus.runtime.settings import env

from .policy import PolicyConfig, parse_goodputs
from .roles import ROLES, RoleBounds, role_configs, role_pool

ACTUATORS = ("dryrun", "local", "kubernetes")


@dataclass(frozen=True)
class AutoscalerSettings:
    nats_url: str = shared.nats_url()
    autoscaler_id: str = env(
        "INFERBUS_AUTOSCALER_ID", "", "This autoscaler's id in its decisions (default: autoscaler-<host name>)."
    )
    pools: str = env(
        "INFERBUS_AUTOSCALER_POOLS",
        "",
        "Model pools to scale, comma-separated (default: INFERBUS_MODEL). Every pool gets the same bounds; run one "
        "autoscaler per pool for different ones.",
    )
    model: str = shared.model("Model id of the pool when INFERBUS_AUTOSCALER_POOLS is empty.")
    actuator: str = env(
        "INFERBUS_AUTOSCALER_ACTUATOR",
        "dryrun",
        "How decisions are carried out: dryrun (publish and log only), local (start/stop simulated workers on this "
        "machine; with INFERBUS_AUTOSCALER_DISAGGREGATED, prefill and decode workers) or kubernetes (the Deployment's "
        "scale subresource).",
    )
    tick_s: float = env("INFERBUS_AUTOSCALER_TICK_S", 5.0, "Seconds between two decisions.")
    rate_window_s: float = env(
        "INFERBUS_AUTOSCALER_RATE_WINDOW_S", 10.0, "Window over which arrival and completion rates are measured."
    )
    latency_window_s: float = env(
        "INFERBUS_AUTOSCALER_LATENCY_WINDOW_S", 30.0, "Window of the p90 TTFT, TPOT and queue-wait signals."
    )
    stale_after_s: float = shared.heartbeat_ttl_s(
        "A worker whose load reports stop for this long is gone (match the workers' heartbeat TTL)."
    )
    ttft_slo_s: float = env(
        "INFERBUS_AUTOSCALER_TTFT_SLO_S", 0.8, "p90 time to first token the pool must hold (seconds)."
    )
    tpot_slo_s: float = env(
        "INFERBUS_AUTOSCALER_TPOT_SLO_S", 0.04, "p90 time per output token the pool must hold (seconds)."
    )
    queue_wait_budget_s: float = env(
        "INFERBUS_AUTOSCALER_QUEUE_WAIT_BUDGET_S",
        0.5,
        "p90 wait from gateway accept to engine start before the pool counts as short of replicas.",
    )
    goodput_rps: float = env(
        "INFERBUS_AUTOSCALER_GOODPUT_RPS",
        4.1,
        "Interactive requests per second one replica serves within the SLO: take it from `inferbus plan` for your mix "
        "and GPU (4.1: H100 TP2 on the worked-example chat mix by the mean-prefill estimate; `inferbus plan` prices "
        "whole prefill chunks and gives 3.07).",
    )
    goodput_by_serving: str = env(
        "INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING",
        "",
        "Where the router pools the replicas' prefill queues, one replica's goodput grows with the replicas serving: "
        "`serving replicas:req/s each` pairs, sizes ascending (`1:2.1,4:2.6,8:2.8`; n replicas serve at the largest "
        "size <= n), from `inferbus plan --emit-deploy`. Empty: INFERBUS_AUTOSCALER_GOODPUT_RPS at every size (which "
        "still sizes the warm pool for a ramp).",
    )
    headroom: float = env(
        "INFERBUS_AUTOSCALER_HEADROOM", 0.15, "Capacity kept above the demand (N+1, bursts, imbalance), as a fraction."
    )
    min_serving: int = env("INFERBUS_AUTOSCALER_MIN_SERVING", 1, "Fewest serving replicas per pool.")
    max_serving: int = env("INFERBUS_AUTOSCALER_MAX_SERVING", 64, "Most serving replicas per pool.")
    min_warm: int = env("INFERBUS_AUTOSCALER_MIN_WARM", 0, "Fewest warm (loaded, idle) replicas per pool.")
    max_warm: int = env("INFERBUS_AUTOSCALER_MAX_WARM", 8, "Most warm replicas per pool.")
    max_replicas: int = env(
        "INFERBUS_AUTOSCALER_MAX_REPLICAS",
        72,
        "Most replicas per pool counting serving, warm and starting ones (the GPU budget).",
    )
    cold_start_s: float = env(
        "INFERBUS_AUTOSCALER_COLD_START_S",
        120.0,
        "Launch to warm: how far ahead the forecast must look to start replicas in time.",
    )
    warm_start_s: float = env(
        "INFERBUS_AUTOSCALER_WARM_START_S", 5.0, "Promote to serving: how far ahead the serving target looks."
    )
    slo_cooldown_s: float = env(
        "INFERBUS_AUTOSCALER_SLO_COOLDOWN_S",
        15.0,
        "After a scale-up driven by SLO pressure, how long before pressure may add more.",
    )
    scale_down_window_s: float = env(
        "INFERBUS_AUTOSCALER_SCALE_DOWN_WINDOW_S",
        300.0,
        "Sustained low load needed before scaling down: the target only drops to the highest need seen in this window.",
    )
    down_step_s: float = env("INFERBUS_AUTOSCALER_DOWN_STEP_S", 30.0, "Seconds between two scale-down steps.")
    max_step_down: float = env(
        "INFERBUS_AUTOSCALER_MAX_STEP_DOWN",
        0.1,
        "Share of the serving replicas one scale-down step may remove (at least one).",
    )
    burst_memory_s: float = env(
        "INFERBUS_AUTOSCALER_BURST_MEMORY_S",
        0.0,
        "How long the warm pool remembers the largest burst (demand over the serving target of one cold start earlier) "
        "and stays sized for it; 0 sizes it from the current ramp only. The simulator proof uses 3600.",
    )
    pending_s: float = env(
        "INFERBUS_AUTOSCALER_PENDING_S",
        30.0,
        "How long a promotion or demotion counts as done before the worker's reports show it.",
    )
    disaggregated: bool = env(
        "INFERBUS_AUTOSCALER_DISAGGREGATED",
        False,
        "Prefill/decode disaggregation: scale each pool's prefill workers and decode workers apart, each on its own "
        "signal (prefill: its TTFT budget and queue; decode: TPOT and KV use). The decode pool takes the bounds and "
        "goodput above (and INFERBUS_AUTOSCALER_K8S_DEPLOYMENTS), the prefill pool the PREFILL_ ones. `inferbus plan "
        "--emit-deploy` sets them from a disaggregated plan.",
    )
    prefill_goodput_rps: float = env(
        "INFERBUS_AUTOSCALER_PREFILL_GOODPUT_RPS",
        4.1,
        "Disaggregated: requests per second one prefill replica serves within its TTFT budget (from `inferbus plan`).",
    )
    prefill_goodput_by_serving: str = env(
        "INFERBUS_AUTOSCALER_PREFILL_GOODPUT_BY_SERVING",
        "",
        "Disaggregated: the prefill pool's goodput per replica by replicas serving, as "
        "INFERBUS_AUTOSCALER_GOODPUT_BY_SERVING (the router pools the prefill queues; from `inferbus plan`).",
    )
    prefill_ttft_budget_s: float = env(
        "INFERBUS_AUTOSCALER_PREFILL_TTFT_BUDGET_S",
        0.6,
        "Disaggregated: p90 the prefill pool's own TTFT (a decode worker's first ask for the prompt to its KV sent; "
        "the wait for a decode worker before that is the decode pool's) must hold: the TTFT SLO less the decode side's "
        "first steps (from `inferbus plan`).",
    )
    prefill_min_serving: int = env(
        "INFERBUS_AUTOSCALER_PREFILL_MIN_SERVING",
        0,
        "Disaggregated: fewest serving prefill replicas per pool; 0: INFERBUS_AUTOSCALER_MIN_SERVING.",
    )
    prefill_max_serving: int = env(
        "INFERBUS_AUTOSCALER_PREFILL_MAX_SERVING", 64, "Disaggregated: most serving prefill replicas per pool."
    )
    prefill_max_warm: int = env(
        "INFERBUS_AUTOSCALER_PREFILL_MAX_WARM", 8, "Disaggregated: most warm prefill replicas per pool."
    )
    prefill_max_replicas: int = env(
        "INFERBUS_AUTOSCALER_PREFILL_MAX_REPLICAS",
        72,
        "Disaggregated: most prefill replicas per pool counting serving, warm and starting ones (their GPU budget).",
    )
    decode_kv_budget: float = env(
        "INFERBUS_AUTOSCALER_DECODE_KV_BUDGET",
        0.9,
        "Disaggregated: KV cache use of the fullest decode replica above which the decode pool is short (the plan's KV "
        "limit).",
    )
    k8s_prefill_deployments: str = env(
        "INFERBUS_AUTOSCALER_K8S_PREFILL_DEPLOYMENTS",
        "worker-prefill",
        "Disaggregated: the prefill worker Deployment per pool, as INFERBUS_AUTOSCALER_K8S_DEPLOYMENTS names the "
        "decode one.",
    )
    local_engine: str = env(
        "INFERBUS_AUTOSCALER_LOCAL_ENGINE",
        "{}",
        "Local actuator: the simulated engine of new replicas, as JSON (gpu, tp, model, time_scale, fixed_step_ms, "
        "engine_args); `inferbus up --autoscale` sets it.",
    )
    local_zones: str = env(
        "INFERBUS_AUTOSCALER_LOCAL_ZONES",
        "",
        "Local actuator: zones to spread replicas over, comma-separated (N+1 per zone: a new replica goes to the zone "
        "with the fewest, a scale-down takes from the one with the most); each replica gets its INFERBUS_ZONE. Empty: "
        "no zones.",
    )
    local_log_dir: str = env(
        "INFERBUS_AUTOSCALER_LOCAL_LOG_DIR",
        ".inferbus/logs",
        "Local actuator: where engine-<n>.log and worker-<n>.log of started replicas go.",
    )
    local_worker_nats_user: str = env(
        "INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_USER",
        "",
        "Local actuator: the NATS user of the workers it starts (a worker identity, not the autoscaler's own); empty: "
        "they inherit NATS_USER. `inferbus up --autoscale` sets it.",
    )
    local_worker_nats_password: str = env(
        "INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_PASSWORD",
        "",
        "Local actuator: the password of INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_USER.",
    )
    k8s_api_url: str = env(
        "INFERBUS_AUTOSCALER_K8S_API_URL",
        "",
        "Kubernetes API server; empty: in-cluster service account, else the local kubeconfig.",
    )
    k8s_namespace: str = env("INFERBUS_AUTOSCALER_K8S_NAMESPACE", "inferbus", "Namespace of the worker Deployments.")
    k8s_deployments: str = env(
        "INFERBUS_AUTOSCALER_K8S_DEPLOYMENTS",
        "worker",
        "Worker Deployment per pool: `name` for a single pool, or `pool=name,pool=name`.",
    )
    metrics_port: int = shared.metrics_port(9103, "the autoscaler's")
    log_level: str = shared.log_level()

    def __post_init__(self) -> None:
        if self.actuator not in ACTUATORS:
            raise SystemExit(
                f"INFERBUS_AUTOSCALER_ACTUATOR must be one of {', '.join(ACTUATORS)}, got {self.actuator!r}"
            )
        for name, value in (
            ("INFERBUS_AUTOSCALER_TICK_S", self.tick_s),
            ("INFERBUS_AUTOSCALER_PENDING_S", self.pending_s),
            ("INFERBUS_AUTOSCALER_RATE_WINDOW_S", self.rate_window_s),
            ("INFERBUS_AUTOSCALER_LATENCY_WINDOW_S", self.latency_window_s),
        ):
            if value <= 0:
                raise SystemExit(f"{name} must be > 0, got {value}")
        if self.min_serving < 1:
            # Gateways refuse requests for a model with no serving worker, so a pool at zero would
            # never see the demand that should wake it.
            raise SystemExit("INFERBUS_AUTOSCALER_MIN_SERVING must be >= 1: scaling from zero is not supported")
        try:
            self.policy_config()
        except ValueError as error:
            named = [f.metadata["env"] for f in dataclasses.fields(self) if re.search(rf"\b{f.name}\b", str(error))]
            raise SystemExit(f"invalid autoscaler settings: {error} (from {', '.join(named)})") from None
        if self.disaggregated:
            if self.prefill_min_serving < 0:
                raise SystemExit("INFERBUS_AUTOSCALER_PREFILL_MIN_SERVING must be >= 0")
            try:
                self.role_configs()
            except ValueError as error:
                raise SystemExit(f"invalid autoscaler settings: {error}") from None
        if self.actuator == "kubernetes":
            self.deployments()
        if self.actuator == "local":
            self.engine_spec()

    def resolved_id(self) -> str:
        return self.autoscaler_id or f"autoscaler-{socket.gethostname()}"

    def pool_list(self) -> list[str]:
        return [p.strip() for p in self.pools.split(",") if p.strip()] or [self.model]

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s, queue_wait_budget_s=self.queue_wait_budget_s,
            goodput_rps=self.goodput_rps, goodput_by_serving=parse_goodputs(self.goodput_by_serving),
            headroom=self.headroom, min_serving=self.min_serving,
            max_serving=self.max_serving, min_warm=self.min_warm, max_warm=self.max_warm,
            max_replicas=self.max_replicas, cold_start_s=self.cold_start_s, warm_start_s=self.warm_start_s,
            slo_cooldown_s=self.slo_cooldown_s, scale_down_window_s=self.scale_down_window_s,
            down_step_s=self.down_step_s, max_step_down=self.max_step_down, burst_memory_s=self.burst_memory_s,
        )

    def role_configs(self) -> dict[str, PolicyConfig]:
        """Disaggregated: the prefill and decode pools' policy configs."""
        return role_configs(
            self.policy_config(),
            prefill=RoleBounds(self.prefill_goodput_rps, self.prefill_max_serving, self.prefill_max_warm,
                               self.prefill_max_replicas, self.prefill_min_serving or None,
                               parse_goodputs(self.prefill_goodput_by_serving)),
            decode=RoleBounds(self.goodput_rps, self.max_serving, self.max_warm, self.max_replicas),
            prefill_ttft_budget_s=self.prefill_ttft_budget_s, decode_kv_budget=self.decode_kv_budget)

    def scaled_pools(self) -> list[tuple[str, str | None, str]]:
        """What is scaled apart: (model pool, role or None, name in decisions and the actuator)."""
        if not self.disaggregated:
            return [(pool, None, pool) for pool in self.pool_list()]
        return [(pool, role, role_pool(pool, role)) for pool in self.pool_list() for role in ROLES]

    def deployments(self) -> dict[str, str]:
        """Scaled pool (`scaled_pools`' name) → worker Deployment name."""
        decode = self._deployments(self.k8s_deployments, "INFERBUS_AUTOSCALER_K8S_DEPLOYMENTS")
        if not self.disaggregated:
            return decode
        prefill = self._deployments(self.k8s_prefill_deployments, "INFERBUS_AUTOSCALER_K8S_PREFILL_DEPLOYMENTS")
        return ({role_pool(pool, "decode"): name for pool, name in decode.items()}
                | {role_pool(pool, "prefill"): name for pool, name in prefill.items()})

    def _deployments(self, text: str, setting: str) -> dict[str, str]:
        """pool → worker Deployment name."""
        raw = text.strip()
        pools = self.pool_list()
        if "=" not in raw:
            if len(pools) != 1 or not raw:
                raise SystemExit(f"{setting} must be `pool=name,...` when scaling several pools")
            return {pools[0]: raw}
        mapping: dict[str, str] = {}
        for item in raw.split(","):
            pool, sep, name = item.partition("=")
            if not sep or not pool.strip() or not name.strip():
                raise SystemExit(f"{setting}: expected pool=name, got {item!r}")
            mapping[pool.strip()] = name.strip()
        missing = [p for p in pools if p not in mapping]
        if missing:
            raise SystemExit(f"{setting} names no Deployment for {', '.join(missing)}")
        return mapping

    def engine_spec(self) -> dict:
        try:
            spec = json.loads(self.local_engine)
        except json.JSONDecodeError as error:
            raise SystemExit(f"INFERBUS_AUTOSCALER_LOCAL_ENGINE is not JSON: {error}") from None
        allowed = {"gpu", "tp", "model", "time_scale", "fixed_step_ms", "engine_args"}
        if not isinstance(spec, dict) or set(spec) - allowed:
            raise SystemExit(f"INFERBUS_AUTOSCALER_LOCAL_ENGINE: expected an object with keys among {sorted(allowed)}")
        return spec
