"""GPU death: an engine that is hung, keeps failing, or stays down is given up, not waited for.

A hung GPU (a stuck kernel, a lost NCCL peer) often leaves the engine's HTTP server answering
while no request makes progress, so neither the engine health probe nor the worker's own liveness
sees it. `GpuDeathDetector` (pure, injected clock) watches what the requests do:

- **hung**: requests are running and none has produced a token for `hang_after_s` (an adapter
  load the engine answered counts as progress: requests queued for their adapters' loads, one at a
  time, produce no token meanwhile on a healthy engine);
- **failing**: `max_errors` requests in a row ended in an engine error, none in between succeeded;
- **down**: the engine has not answered its readiness probe for `down_after_s`.

The worker then gives the replica up (`give_up`): it stops pulling, says `draining` (nothing more
is placed on it), hands its streams off (each gateway continues its request on another worker
from what the client has: the migration path), aborts them in the engine, deletes its heartbeat
and exits with `EXIT_GPU_DEATH`, so that its supervisor (Kubernetes, `inferbus up`) replaces the
replica instead of this process waiting on a GPU that will not come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from prometheus_client import Counter

from inferbus.runtime import logs
from inferbus.runtime.supervise import EXIT_GPU_DEATH

if TYPE_CHECKING:
    from .attempt import Attempt
    from .engine import EngineClient
    from .settings import WorkerSettings


GPU_DEATHS = Counter("inferbus_worker_gpu_deaths_total", "Replicas this worker gave up on a dead engine", ["reason"])

log = logs.get(__name__)


class GpuDeathDetector:
    def __init__(self, clock: Callable[[], float], *, hang_after_s: float = 30.0, down_after_s: float = 60.0,
                 max_errors: int = 5) -> None:
        self.clock = clock
        self.hang_after_s = hang_after_s
        self.down_after_s = down_after_s
        self.max_errors = max_errors
        self.last_progress = clock()
        self.errors_in_row = 0

    def progress(self) -> None:
        """A request produced tokens (or finished): the engine works."""
        self.last_progress = self.clock()
        self.errors_in_row = 0

    def engine_error(self) -> None:
        self.errors_in_row += 1

    def worker_paused(self) -> None:
        """This worker's own process was stopped (SIGSTOP, a frozen host): the time it could not
        read tokens says nothing about the engine, so the hang clock starts again now."""
        self.last_progress = self.clock()

    def verdict(self, running: int, engine_down_since: float | None) -> str | None:
        """None while the engine may still be fine; else why it is given up: `engine_hung`,
        `engine_failing` or `engine_down`. Call it periodically with the requests the engine holds
        and since when (monotonic clock) the engine has not answered, if it does not."""
        now = self.clock()
        if running == 0:
            self.last_progress = now  # idle is not hung: the hang clock starts with work
        elif self.hang_after_s > 0 and now - self.last_progress > self.hang_after_s:
            return "engine_hung"
        if self.max_errors > 0 and self.errors_in_row >= self.max_errors:
            return "engine_failing"
        if self.down_after_s > 0 and engine_down_since is not None and now - engine_down_since > self.down_after_s:
            return "engine_down"
        return None


class GivingUp(Protocol):
    """What `give_up` may touch of its worker: the flags it sets, the requests it hands off, and
    the worker's own ways to stop pulling, say so, and stop."""

    leaving: bool
    draining: bool
    exit_code: int

    @property
    def settings(self) -> WorkerSettings: ...
    @property
    def engine(self) -> EngineClient: ...
    @property
    def running(self) -> dict[str, Attempt]: ...

    async def stop_pulling(self) -> None: ...
    async def announce(self) -> None: ...
    async def stop(self) -> None: ...


async def give_up(worker: GivingUp, reason: str, *, handoff_timeout_s: float = 2.0,
                  abort_timeout_s: float = 1.0) -> None:
    """Hand off the streams, leave the fleet and exit (see the module's docstring)."""
    if worker.leaving:
        return
    worker.leaving = worker.draining = True
    worker.exit_code = EXIT_GPU_DEATH
    GPU_DEATHS.labels(reason).inc()
    log.error("gpu_death", reason=reason, in_flight=len(worker.running), engine=worker.settings.engine_url)
    await worker.stop_pulling()
    await worker.announce()  # draining: routers and gateways place nothing here
    for entry in list(worker.running.values()):
        if entry.preemptible:
            entry.requeue = "drain"  # a batch line goes back to its queue with its progress
        else:
            entry.handed_off = True  # the gateway continues the stream elsewhere
        with contextlib.suppress(Exception):
            await asyncio.wait_for(worker.engine.abort(entry.request.engine_rid()), abort_timeout_s)
    deadline = time.monotonic() + handoff_timeout_s
    while worker.running and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if worker.running:
        # The engine did not even end the streams: the heartbeat's deletion (in stop) tells the
        # gateways this worker is gone, and they continue these requests elsewhere.
        log.warning("gpu_death_streams_not_handed_off", count=len(worker.running))
        for entry in list(worker.running.values()):
            entry.superseded = True  # its work is the platform's; the gateway bills what the client got
            if entry.task is not None:
                entry.task.cancel()
    await worker.stop()
