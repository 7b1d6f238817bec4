"""The autoscaler's shell: worker load reports in, a decision per pool per tick out.

Each tick, per pool (with INFERBUS_AUTOSCALER_DISAGGREGATED, per pool and role: its prefill workers
and its decode workers are two pools, each decided on its own signal by `roles.DisaggregatedPolicy`):
snapshot the signals (pure), ask the policy (pure), plan promotions,
demotions and the replica count (pure), publish the decision on `inferbus.scale.<pool>`, log it,
export it, then let the actuator act. A failing actuator is logged and retried next tick; the
decision is out on the bus either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, start_http_server

from inferbus.bus import connection as bus
from inferbus.local.replicas import EngineSpec
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

from .actuators.base import Actuator
from .policy import AutoscalePolicy, Decision, Plan, Reconciler
from .roles import DisaggregatedPolicy, role_pool
from .settings import AutoscalerSettings
from .signals import PoolSignals, SignalAggregator

log = logs.get(__name__)

DESIRED = Gauge("inferbus_autoscaler_desired_replicas", "Replicas the autoscaler asks for", ["pool", "kind"])
REPLICAS = Gauge("inferbus_autoscaler_replicas", "Replicas by phase, as the autoscaler sees them", ["pool", "phase"])
DECISIONS = Counter("inferbus_autoscaler_decisions_total", "Decisions by direction", ["pool", "direction"])
ACTIONS = Counter("inferbus_autoscaler_actions_total", "Actions carried out", ["pool", "action"])
ACTUATOR_ERRORS = Counter("inferbus_autoscaler_actuator_errors_total", "Actuator calls that failed", ["pool"])
SIGNAL = Gauge("inferbus_autoscaler_signal", "Signal values behind the last decision (seconds, req/s, ratios)",
               ["pool", "signal"])

_load_decoder = msgspec.msgpack.Decoder(m.WorkerLoad)


def make_actuator(settings: AutoscalerSettings) -> Actuator:
    if settings.actuator == "local":
        from .actuators.local import LocalActuator

        pools = settings.pool_list()
        if len(pools) != 1:
            raise SystemExit("the local actuator runs one pool: set a single INFERBUS_AUTOSCALER_POOLS")
        # Disaggregated: the model's prefill pool and decode pool, each of its role's replicas.
        roles = {name: role or "aggregated" for _, role, name in settings.scaled_pools()}
        raw = settings.engine_spec()
        spec = EngineSpec(gpu=raw.get("gpu", "H100"), tp=int(raw.get("tp", 2)), model=raw.get("model", pools[0]),
                          time_scale=float(raw.get("time_scale", 1.0)), fixed_step_ms=raw.get("fixed_step_ms"),
                          engine_args=tuple(raw.get("engine_args", ())))
        replica_env = dict(os.environ)
        if settings.local_worker_nats_user:  # the workers' own identity, never the autoscaler's
            replica_env.update(
                NATS_USER=settings.local_worker_nats_user, NATS_PASSWORD=settings.local_worker_nats_password
            )
        return LocalActuator(roles, spec, Path(settings.local_log_dir), cold_start_s=settings.cold_start_s,
                             warm_start_s=settings.warm_start_s, env=replica_env,
                             zones=[z.strip() for z in settings.local_zones.split(",") if z.strip()])
    if settings.actuator == "kubernetes":
        from .actuators.kubernetes import KubernetesActuator

        return KubernetesActuator(settings.k8s_namespace, settings.deployments(), api_url=settings.k8s_api_url)
    from .actuators.dryrun import DryRunActuator

    return DryRunActuator()


def with_unseen_replicas(signals: PoolSignals, launched: int | None) -> PoolSignals:
    """Replicas the actuator runs that have not reported yet are starting (a process still
    importing, a pod still pulling its image)."""
    if launched is None:
        return signals
    seen = signals.serving + signals.warm + signals.starting + signals.draining
    return dataclasses.replace(signals, starting=signals.starting + max(0, launched - seen))


def decision_message(
    decision: Decision, signals: PoolSignals, plan: Plan, autoscaler_id: str, actuator: str
) -> m.ScaleDecision:
    return m.ScaleDecision(
        pool=decision.pool, ts=time.time(), direction=decision.direction, serving=signals.serving, warm=signals.warm,
        starting=signals.starting, draining=signals.draining, desired_serving=decision.desired_serving,
        desired_warm=decision.desired_warm, reason=decision.reason, autoscaler_id=autoscaler_id, actuator=actuator,
        arrival_rate=signals.arrival_rate, forecast_rate=decision.forecast_rate, capacity_rate=decision.capacity_rate,
        ttft_p90_s=signals.ttft_p90_s, tpot_p90_s=signals.tpot_p90_s, queue_wait_s=signals.queue_wait_s,
        waiting=signals.waiting, running=signals.running, kv_usage=signals.kv_usage,
        batch_in_flight=signals.batch_in_flight, promote=list(plan.promote), demote=list(plan.demote),
    )


class Autoscaler:
    def __init__(self, settings: AutoscalerSettings, actuator: Actuator, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.settings = settings
        self.actuator = actuator
        self.id = settings.resolved_id()
        self.aggregator = SignalAggregator(clock, rate_window_s=settings.rate_window_s,
                                           latency_window_s=settings.latency_window_s,
                                           stale_after_s=settings.stale_after_s)
        self.policy = AutoscalePolicy(clock, settings.policy_config())
        self.roles = DisaggregatedPolicy(clock, settings.role_configs()) if settings.disaggregated else None
        self.reconciler = Reconciler(clock, pending_s=settings.pending_s)
        self.nc: Client | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.nc = await bus.connect(self.settings.nats_url, name=self.id)
        self.actuator.bind(self._send_control)
        await self.actuator.start()
        await self.nc.subscribe(subjects.metrics_wildcard(), cb=self._on_load)
        self._task = asyncio.create_task(self._loop(), name="ticks")
        log.info("autoscaler_ready", autoscaler_id=self.id, pools=[name for _, _, name in self.settings.scaled_pools()],
                 actuator=self.actuator.name, tick_s=self.settings.tick_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.actuator.close()
        if self.nc is not None:
            await self.nc.drain()

    async def _send_control(self, worker_id: str, command: m.ControlCommand) -> None:
        assert self.nc is not None
        await self.nc.publish(subjects.control_subject(worker_id), m.encode(command))

    async def _on_load(self, msg: Msg) -> None:
        try:
            self.aggregator.on_load(_load_decoder.decode(msg.data))
        except msgspec.DecodeError as error:
            log.warning("bad_load_message", error=str(error))

    async def _loop(self) -> None:
        # Let a tick's worth of reports arrive first: deciding on an empty view would look idle.
        await asyncio.sleep(self.settings.tick_s)
        while True:
            started = time.monotonic()
            for pool, role, _ in self.settings.scaled_pools():
                try:
                    await self.tick(pool, role)
                except Exception:
                    log.exception("tick_failed", pool=pool, role=role)
            await asyncio.sleep(max(0.0, self.settings.tick_s - (time.monotonic() - started)))

    async def tick(self, model: str, role: str | None = None) -> Decision:
        """One decision for `model`'s pool, or with `role` for its pool of that role's workers."""
        assert self.nc is not None
        pool = model if role is None else role_pool(model, role)
        launched: int | None = None
        try:
            fleet = (await self.actuator.current()).pools.get(pool)
            launched = fleet.replicas if fleet is not None else None
        except Exception as error:
            ACTUATOR_ERRORS.labels(pool).inc()
            log.warning("actuator_read_failed", pool=pool, actuator=self.actuator.name, error=repr(error))
        signals = with_unseen_replicas(self.aggregator.snapshot(model, role, pool), launched)
        if role is None:
            decision = self.policy.decide(signals)
        else:
            if self.roles is None:
                raise ValueError(f"a {role} pool is scaled only with INFERBUS_AUTOSCALER_DISAGGREGATED")
            decision = self.roles.decide(role, signals)
        running = (
            launched if launched is not None else signals.serving + signals.warm + signals.starting + signals.draining
        )
        plan = self.reconciler.plan(decision, signals, running)
        message = decision_message(decision, signals, plan, self.id, self.actuator.name)
        await self.nc.publish(subjects.scale_subject(pool), m.encode(message))
        self._export(decision, signals)
        log.info("scale_decision", pool=pool, direction=decision.direction, reason=decision.reason,
                 serving=signals.serving, warm=signals.warm, starting=signals.starting, draining=signals.draining,
                 desired_serving=decision.desired_serving, desired_warm=decision.desired_warm,
                 replicas=plan.replicas, promote=list(plan.promote), demote=list(plan.demote),
                 retire=list(plan.retire), arrival_rate=round(signals.arrival_rate, 3),
                 forecast_rate=round(decision.forecast_rate, 3), ttft_p90_s=signals.ttft_p90_s,
                 tpot_p90_s=signals.tpot_p90_s, queue_wait_s=round(signals.queue_wait_s, 3),
                 kv_usage=round(signals.kv_usage, 3), in_flight=signals.in_flight,
                 batch_in_flight=signals.batch_in_flight, pressure=round(decision.pressure, 3))
        await self._act(pool, plan, running)
        return decision

    async def _act(self, pool: str, plan: Plan, running: int) -> None:
        try:
            for worker_id in plan.promote:
                await self.actuator.promote(pool, worker_id)
                ACTIONS.labels(pool, "promote").inc()
            for worker_id in plan.demote:
                await self.actuator.demote(pool, worker_id)
                ACTIONS.labels(pool, "demote").inc()
            if plan.replicas != running or plan.retire:
                await self.actuator.scale(pool, plan.replicas, plan.retire)
                ACTIONS.labels(pool, "launch").inc(max(0, plan.replicas - running))
                ACTIONS.labels(pool, "retire").inc(len(plan.retire))
        except Exception as error:
            ACTUATOR_ERRORS.labels(pool).inc()
            log.warning("actuator_failed", pool=pool, actuator=self.actuator.name, error=repr(error))

    def _export(self, decision: Decision, s: PoolSignals) -> None:
        pool = decision.pool
        DECISIONS.labels(pool, decision.direction).inc()
        DESIRED.labels(pool, "serving").set(decision.desired_serving)
        DESIRED.labels(pool, "warm").set(decision.desired_warm)
        for phase, count in (
            ("serving", s.serving),
            ("warm", s.warm),
            ("starting", s.starting),
            ("draining", s.draining),
        ):
            REPLICAS.labels(pool, phase).set(count)
        for name, value in (("arrival_rate", s.arrival_rate), ("forecast_rate", decision.forecast_rate),
                            ("ttft_p90_seconds", s.ttft_p90_s), ("tpot_p90_seconds", s.tpot_p90_s),
                            ("queue_wait_seconds", s.queue_wait_s), ("kv_usage", s.kv_usage),
                            ("waiting", s.waiting), ("in_flight", s.in_flight),
                            ("batch_in_flight", s.batch_in_flight), ("pressure", decision.pressure)):
            SIGNAL.labels(pool, name).set(float("nan") if value is None else value)


async def serve(settings: AutoscalerSettings) -> None:
    logs.configure("autoscaler", settings.log_level)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="0.0.0.0")
    autoscaler = Autoscaler(settings, make_actuator(settings))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await autoscaler.start()
    await stop.wait()
    await autoscaler.stop()
    log.info("autoscaler_stopped")
