"""The canary controller, run by every router replica: reads the gates, moves the share.

Why the router: it already receives every worker's load report (the SLO gate's histograms and
outcome counters, labelled by release) and runs wherever the platform runs; the decisions are
few and small. Replicas agree through the `models` bucket: each writes its decision with
compare-and-set on the rollout's revision, so one replica's decision wins and the others, finding
the rollout changed, read it again. The winner publishes the decision with its reason on
`inferbus.release.<model>`. The split itself is done by the gateways (`services/gateway/releases.py`)
from the same rollout record; this replica places a request on a worker of the release it names.

A LoRA adapter's canary (two versions of one adapter, within its requests) is decided the same
way, on the per-version histograms and outcomes workers report for adapters with a canary
(`WorkerLoad.adapter_outcomes`); its decisions go to `inferbus.release.<adapter>`. Its promotion
and rollback also settle the adapter's registration (the promoted version becomes the registered
one; a rolled-back candidate is dropped), so the registry says what serves once the canary is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from inferbus.releases import canary, slo_gate, store
from inferbus.releases.follow import Rollouts
from inferbus.runtime import logs
from inferbus.stores import adapters as registry
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

DECISIONS = Counter("inferbus_release_decisions_total", "Canary decisions made by this replica", ["model", "action"])
SHARE = Gauge(
    "inferbus_release_candidate_share",
    "Share of a model's traffic sent to its candidate release",
    ["model", "candidate"],
)


class CanaryService:
    def __init__(self, nc: Client, controller_id: str, config: slo_gate.SloConfig, tick_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.controller_id = controller_id
        self.config = config
        self.tick_s = tick_s
        self.clock = clock  # wall time: step starts are stored in the bucket and read by every replica
        self.controller = canary.Controller(clock, config)
        self.rollouts = Rollouts()
        self.windows: dict[str, slo_gate.Windows] = {}  # model → per-release windows of its current step
        self._window_of: dict[str, tuple[str | None, float]] = {}  # model → (candidate, step start) counted
        self.adapter_windows = slo_gate.AdapterWindows()  # per adapter version, of its canary's current step
        self._adapter_window_of: dict[str, tuple[str | None, float]] = {}  # adapter → (candidate, step start)
        self._adapters: KeyValue | None = None  # the adapter registry (a canary's candidate must stay in it)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.rollouts.start(self.nc.jetstream())
        self._adapters = await registry.bucket(self.nc.jetstream())
        self._task = asyncio.create_task(self._loop(), name="canary")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.rollouts.stop()

    def on_load(self, load: m.WorkerLoad) -> None:
        if load.role == "prefill":  # its latencies are the prefill pool's, not the client's
            return
        if load.release:
            self.windows.setdefault(load.model, slo_gate.Windows()).on_load(load)
        self.adapter_windows.on_load(load)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for model, rollout in list(self.rollouts.by_model.items()):
                try:
                    await self.tick(model, rollout)
                except Exception as error:  # one model's trouble must not stop the others' canaries
                    log.warning("canary_tick_failed", model=model, error=repr(error))
            for adapter, rollout in list(self.rollouts.by_adapter.items()):
                try:
                    await self.tick_adapter(adapter, rollout)
                except Exception as error:
                    log.warning("canary_tick_failed", model=rollout.model, adapter=adapter, error=repr(error))

    async def tick(self, model: str, rollout: m.Rollout) -> None:
        if rollout.state != "canary":
            SHARE.labels(model, rollout.candidate or "").set(0 if rollout.state != "promoted" else 1)
            return
        SHARE.labels(model, rollout.candidate or "").set(rollout.share)
        windows = self.windows.setdefault(model, slo_gate.Windows())
        step = (rollout.candidate, rollout.step_started)
        if self._window_of.get(model) != step:
            windows.reset()  # a new step: the gate reads only what happened at this share
            self._window_of[model] = step
        assert rollout.candidate is not None
        verdict = slo_gate.verdict(windows.of(rollout.stable), windows.of(rollout.candidate), self.config,
                                   canary.judged_steps(rollout))
        await self._decide(rollout, verdict, self.rollouts.revisions.get(model, 0))

    async def tick_adapter(self, adapter: str, rollout: m.Rollout) -> None:
        """The same for an adapter's canary: its two versions' requests, as every worker reports them."""
        assert rollout.adapter == adapter
        candidate = m.adapter_engine_name(adapter, rollout.candidate) if rollout.candidate else ""
        if rollout.state != "canary":
            SHARE.labels(adapter, candidate).set(0 if rollout.state != "promoted" else 1)
            return
        SHARE.labels(adapter, candidate).set(rollout.share)
        assert self._adapters is not None
        revision = self.rollouts.adapter_revisions.get(adapter, 0)
        orphaned = canary.unregistered_candidate(rollout, await registry.get(self._adapters, adapter), self.clock())
        if orphaned is not None:
            await self._apply(rollout, orphaned, revision)
            return
        stable = m.adapter_engine_name(adapter, rollout.stable)
        step = (rollout.candidate, rollout.step_started)
        if self._adapter_window_of.get(adapter) != step:
            self.adapter_windows.reset({stable, candidate})
            self._adapter_window_of[adapter] = step
        verdict = slo_gate.verdict(self.adapter_windows.of(stable), self.adapter_windows.of(candidate), self.config,
                                   canary.judged_steps(rollout))
        await self._decide(rollout, verdict, revision)

    async def _decide(self, rollout: m.Rollout, verdict: slo_gate.Verdict, revision: int) -> None:
        change = self.controller.decide(rollout, verdict)
        if change is not None:
            await self._apply(rollout, change, revision)

    async def _apply(self, rollout: m.Rollout, change: canary.Change, revision: int) -> None:
        assert self.rollouts.kv is not None
        try:
            await store.put_rollout(self.rollouts.kv, change.rollout, revision)
        except store.Conflict:
            return  # another replica (or an operator) changed it first: decide again on the new state
        if rollout.adapter and change.action in ("promote", "rollback"):
            if not await store.settle_adapter(self.nc.jetstream(), change.rollout):
                log.warning("adapter_settle_failed", adapter=rollout.adapter, why="its registration kept changing")
        decision = m.ReleaseDecision(
            model=rollout.model, ts=self.clock(), action=change.action, stable=rollout.stable,  # type: ignore[arg-type]
            candidate=rollout.candidate, share_before=rollout.share, share_after=change.rollout.share,
            reason=change.reason, slo=change.slo, controller=self.controller_id, adapter=rollout.adapter,
        )
        await self.nc.publish(subjects.release_subject(rollout.adapter or rollout.model), m.encode(decision))
        DECISIONS.labels(rollout.adapter or rollout.model, change.action).inc()
        log.info("release_decision", model=rollout.model, adapter=rollout.adapter, action=change.action,
                 candidate=rollout.candidate, share_before=rollout.share, share_after=change.rollout.share,
                 reason=change.reason)

