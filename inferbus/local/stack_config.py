"""What a local platform is made of (`StackConfig`) and what follows from it alone, as pure
functions: each worker's role, the engines' spec, how many workers must be serving before the
platform is, and the autoscaler's settings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from inferbus.bus.auth import Identity
from inferbus.local.replicas import EngineSpec


@dataclass
class StackConfig:
    state_dir: Path
    workers: int = 2
    gpu: str = "H100"
    tp: int = 2
    model: str = "meta-llama/Llama-3.3-70B-Instruct"
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8080
    nats_url: str | None = None  # None: start our own
    redis_url: str | None = None  # None: start our own unless REDIS_URL is reachable
    time_scale: float = 1.0
    fixed_step_ms: float | None = None
    router: bool = True
    batch: bool = True  # the batch service (its workers pull the batch band by default)
    admin_key: str = ""  # the gateway's INFERBUS_ADMIN_KEY; empty: inherit it from the environment, if set
    log_level: str = "info"
    extra_env: dict[str, str] = field(default_factory=dict)
    engine_args: list[str] = field(default_factory=list)
    # Autoscaling: no static workers; the autoscaler (local actuator) starts min_workers, and more
    # up to max_workers, each with a simulated cold start, keeping a warm pool it promotes from.
    autoscale: bool = False
    min_workers: int = 1
    max_workers: int = 4
    cold_start_s: float = 20.0
    warm_start_s: float = 2.0
    autoscaler_env: dict[str, str] = field(default_factory=dict)
    # The served model's directory (tokenizer, chat template) for the gateway, batch service and
    # engines; None: $INFERBUS_MODEL_DIR, else a small one built under state_dir (`chat_format`).
    model_dir: Path | None = None
    chat_format: str = "llama3"
    # TLS on the NATS client port (the NATS this stack starts): a new local CA and server
    # certificate in state_dir/tls, services verify the server against that CA.
    tls: bool = False
    # Every service authorized by `inferbus auth-callout` with a token of its own instead of a
    # password, as deploy/k8s/per-pod-identities does with pods' ServiceAccount tokens.
    callout: bool = False
    # Zones (> 1: a NATS cluster with a node per zone and JetStream R3, Redis primary + replica
    # with a sentinel per zone, a router and a gateway per zone, workers spread over the zones).
    zones: int = 1
    # Prefill/decode disaggregation: this many prefill and decode workers (worker-1.. are the
    # prefill ones) instead of `workers` aggregated ones; both 0: aggregated. With `autoscale`, each
    # pool's fewest serving workers (instead of min_workers), up to max_workers each, scaled apart.
    prefill: int = 0
    decode: int = 0

    def __post_init__(self) -> None:
        if self.prefill or self.decode:
            if self.prefill < 1 or self.decode < 1:
                raise ValueError("a disaggregated fleet needs at least one prefill and one decode worker")
            if self.autoscale and max(self.prefill, self.decode) > self.max_workers:
                raise ValueError(f"autoscaled prefill ({self.prefill}) and decode ({self.decode}) pools start at "
                                 f"most max_workers ({self.max_workers}) each")
            self.workers = self.prefill + self.decode

    def role_of(self, index: int) -> str:
        """The role of worker-<index> (1-based)."""
        if not (self.prefill or self.decode):
            return "aggregated"
        return "prefill" if index <= self.prefill else "decode"

    def engine_spec(self) -> EngineSpec:
        return EngineSpec(self.gpu, self.tp, self.model, self.time_scale, self.fixed_step_ms, tuple(self.engine_args))

    def serving_workers_needed(self) -> int:
        """How many workers the gateway must see before the platform serves: the static ones, or
        the autoscaler's first (both pools' fewest, when disaggregated)."""
        if not self.autoscale:
            return self.workers
        return self.prefill + self.decode if self.prefill else self.min_workers


# Minutes-long production windows would make a local demo dull: shorter ones, unless the
# environment sets them.
LOCAL_AUTOSCALER_WINDOWS = (("INFERBUS_AUTOSCALER_TICK_S", "1"), ("INFERBUS_AUTOSCALER_SCALE_DOWN_WINDOW_S", "60"),
                            ("INFERBUS_AUTOSCALER_DOWN_STEP_S", "10"))


def autoscaler_env(config: StackConfig, worker: Identity | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The local actuator's settings: where and how to start replicas, within which bounds. `worker`:
    the role-wide identity of the workers it starts (None with an outside NATS); `environ`: the
    launcher's environment, whose settings win over the local defaults."""
    c = config
    spec = c.engine_spec()
    env = {
        "INFERBUS_AUTOSCALER_ACTUATOR": "local",
        "INFERBUS_METRICS_PORT": "0",
        "INFERBUS_AUTOSCALER_MIN_SERVING": str(c.min_workers),
        "INFERBUS_AUTOSCALER_MAX_SERVING": str(c.max_workers),
        "INFERBUS_AUTOSCALER_MAX_REPLICAS": str(c.max_workers),
        "INFERBUS_AUTOSCALER_COLD_START_S": str(c.cold_start_s),
        "INFERBUS_AUTOSCALER_WARM_START_S": str(c.warm_start_s),
        "INFERBUS_AUTOSCALER_LOCAL_LOG_DIR": str(c.state_dir / "logs"),
        **(
            {
                "INFERBUS_AUTOSCALER_DISAGGREGATED": "true",
                "INFERBUS_AUTOSCALER_MIN_SERVING": str(c.decode),
                "INFERBUS_AUTOSCALER_PREFILL_MIN_SERVING": str(c.prefill),
                "INFERBUS_AUTOSCALER_PREFILL_MAX_SERVING": str(c.max_workers),
                "INFERBUS_AUTOSCALER_PREFILL_MAX_REPLICAS": str(c.max_workers),
            }
            if c.prefill
            else {}
        ),
        **(
            {
                "INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_USER": worker.user,
                "INFERBUS_AUTOSCALER_LOCAL_WORKER_NATS_PASSWORD": worker.password,
            }
            if worker is not None
            else {}
        ),
        "INFERBUS_AUTOSCALER_LOCAL_ENGINE": json.dumps(
            {
                "gpu": spec.gpu,
                "tp": spec.tp,
                "model": spec.model,
                "time_scale": spec.time_scale,
                "fixed_step_ms": spec.fixed_step_ms,
                "engine_args": list(spec.engine_args),
            }
        ),
    }
    for name, value in LOCAL_AUTOSCALER_WINDOWS:
        if name not in environ and name not in c.extra_env:
            env[name] = value
    env.update(c.autoscaler_env)
    return env
