"""Engine down and back, and pauses: a worker that cannot serve stops pulling until it can.

- The engine stops answering: the worker says "not ready" in its heartbeat (gateways and routers
  stop counting on it), pulls nothing, and probes the engine with backoff (`EngineHealth`). When
  it answers again it may be a new process: what the worker believed about it (its adapters, its
  prefix cache, its limits) is learned again.
- The worker's own process was paused (SIGSTOP, a frozen host; `PauseDetector`) or a consumer
  went missing (a router deletes those of a worker it thought dead): before it pulls again, it
  verifies that the engine answers and its consumers exist, and its heartbeat says "draining"
  from the moment it notices until then (nothing is placed on it).
- The engine is hung, keeps failing or stays down too long (`gpu_death.GpuDeathDetector`, asked on
  every tick): the worker hands its streams off and exits so that its replica is replaced. A pause
  of the worker itself restarts the hang clock: its streams made no progress because it was
  stopped, not its engine.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from inferbus.bus import connection as bus
from inferbus.runtime import logs

from .gpu_death import give_up
from .metrics import PAUSES
from .roles import bootstrap_address

if TYPE_CHECKING:
    from .service import Worker

log = logs.get(__name__)

TICK_S = 0.25  # the event loop's tick: a gap much longer than this means the worker was paused


class EngineWatch:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.holding_pulls = False  # verifying engine and consumers: pull nothing until done
        self._probing: asyncio.Task[None] | None = None
        self._verifying: asyncio.Task[None] | None = None
        self._giving_up: asyncio.Task[None] | None = None  # gpu_death.give_up, once

    def stop(self) -> None:
        if self._probing is not None:
            self._probing.cancel()

    # ---- the engine ------------------------------------------------------------------------

    def down(self, why: str) -> None:
        """Stop pulling and say not ready until the engine answers again; probe it with backoff."""
        worker = self.worker
        if not worker.health.up:
            return
        worker.health.failed()
        log.warning("engine_down", engine=worker.settings.engine_url, why=why)
        # Not ready: gateways and routers stop counting on it.
        worker.background.spawn(worker.reporter.publish_heartbeat())
        if self._probing is None or self._probing.done():
            self._probing = asyncio.create_task(self._probe(), name="engine-watch")

    async def _probe(self) -> None:
        worker = self.worker
        health = worker.health
        delay = health.first_delay_s
        while True:
            await asyncio.sleep(delay)
            if await worker.engine.ready():
                break
            delay = health.failed()
            log.info("engine_probe_failed", engine=worker.settings.engine_url, failures=health.failures,
                     retry_in_s=round(delay, 3))
        # It answers again, maybe as a new process: what this worker believed about it is stale.
        try:
            worker.engine_info = await worker.engine.server_info()
        except Exception as error:
            log.warning("engine_info_failed", error=repr(error))
        if worker.prefill is not None:  # a new prefill engine may serve its bootstrap server on another port
            s = worker.settings
            worker.prefill.bootstrap_host, worker.prefill.bootstrap_port = bootstrap_address(
                worker.engine_info, s.engine_url, s.engine_bootstrap_host)
        forgotten = len(worker.adapters.loaded)
        await worker.adapters.resync(restarted=True)
        if worker.cache_relay is not None:
            try:
                await worker.cache_relay.engine_restarted()
            except Exception as error:  # the router's index ages stale blocks out regardless
                log.warning("cache_reset_failed", error=repr(error))
        health.recovered()
        log.info("engine_back", engine=worker.settings.engine_url, adapters_forgotten=forgotten)
        await worker.reporter.publish_heartbeat()
        worker.wake.set()
        worker.load_changed.set()

    # ---- pauses: no zombie -----------------------------------------------------------------

    async def tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()
            worker = self.worker
            serving = worker.phase == "serving"
            reason = worker.gpu.verdict(len(worker.running), worker.health.down_since) if serving else None
            if reason is not None and not worker.leaving:
                self._giving_up = asyncio.ensure_future(give_up(worker, reason))

    def tick(self) -> None:
        """Note that the loop runs; after a pause (SIGSTOP, a frozen host) verify before pulling."""
        worker = self.worker
        if not worker.pause.tick():
            return
        PAUSES.inc()
        worker.gpu.worker_paused()  # (before this tick's verdict: the pause is not the engine's hang)
        log.warning("worker_resumed_after_pause", pauses=worker.pause.epoch, in_flight=len(worker.running))
        self.verify_soon("paused")

    def verify_soon(self, why: str) -> None:
        worker = self.worker
        if worker.phase != "serving" or worker.leaving or (self._verifying is not None and not self._verifying.done()):
            return
        self.holding_pulls = True
        # Now, not at the next heartbeat: the liveness thread would keep saying "ready" from before
        # the pause, and gateways and routers would place requests this worker does not pull yet.
        worker.liveness.set_beat(worker.reporter.beat())
        worker.background.spawn(worker.reporter.publish_heartbeat())
        self._verifying = asyncio.ensure_future(self._verify(why))

    async def _verify(self, why: str) -> None:
        """After a pause or an engine failure: the engine answers, our consumers exist (a router
        deletes those of a worker it thought dead), our pull requests are live. Until then pull
        nothing: a request pulled into a broken worker would hang its client."""
        worker = self.worker
        self.holding_pulls = True  # the heartbeat says "draining" meanwhile: nothing is placed here
        try:
            delay = 0.2
            while not await worker.engine.ready():
                log.warning("engine_not_ready", why=why)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
            await bus.retry_forever("bus setup after a pause", worker.setup_bus)
        finally:
            self.holding_pulls = False
        if worker.serving is not None:
            for puller in worker.serving.pullers:  # pull requests made before the pause expired meanwhile
                puller.forget_pulls()
        worker.wake.set()
        worker.load_changed.set()
        log.info("worker_verified", why=why)
        await worker.reporter.publish_heartbeat()  # ready again: placements may come here
