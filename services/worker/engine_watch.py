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
from typing import TYPE_CHECKING, Any, Protocol

from inferbus.bus import connection as bus
from inferbus.runtime import logs

from .gpu_death import GivingUp, give_up
from .metrics import PAUSES

if TYPE_CHECKING:
    from .adapters import Adapters
    from .cache_events import CacheRelay
    from .engine_health import EngineHealth
    from .gpu_death import GpuDeathDetector
    from .liveness import PauseDetector
    from .tasks import Background

log = logs.get(__name__)

TICK_S = 0.25  # the event loop's tick: a gap much longer than this means the worker was paused


class Watched(GivingUp, Protocol):
    """What the engine watch may touch of its worker (and, on a GPU death, `give_up`)."""

    engine_info: dict[str, Any]  # learned again when the engine comes back

    @property
    def health(self) -> EngineHealth: ...
    @property
    def pause(self) -> PauseDetector: ...
    @property
    def gpu(self) -> GpuDeathDetector: ...
    @property
    def adapters(self) -> Adapters: ...
    @property
    def cache_relay(self) -> CacheRelay | None: ...
    @property
    def background(self) -> Background: ...
    @property
    def phase(self) -> str: ...
    @property
    def wake(self) -> asyncio.Event: ...
    @property
    def load_changed(self) -> asyncio.Event: ...

    def refresh_beat(self) -> None: ...
    async def setup_bus(self) -> None: ...
    def forget_pulls(self) -> None: ...
    def relearn_bootstrap(self) -> None: ...


class EngineWatch:
    def __init__(self, worker: Watched) -> None:
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
        worker.background.spawn(worker.announce())
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
        worker.relearn_bootstrap()  # a new prefill engine may serve its bootstrap server on another port
        forgotten = len(worker.adapters.loaded)
        await worker.adapters.resync(restarted=True)
        if worker.cache_relay is not None:
            try:
                await worker.cache_relay.engine_restarted()
            except Exception as error:  # the router's index ages stale blocks out regardless
                log.warning("cache_reset_failed", error=repr(error))
        health.recovered()
        log.info("engine_back", engine=worker.settings.engine_url, adapters_forgotten=forgotten)
        await worker.announce()
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
        worker.refresh_beat()
        worker.background.spawn(worker.announce())
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
        worker.forget_pulls()  # pull requests made before the pause expired meanwhile
        worker.wake.set()
        worker.load_changed.set()
        log.info("worker_verified", why=why)
        await worker.announce()  # ready again: placements may come here
