"""A worker that notices it was paused says "draining" at once, not at its next heartbeat: the
liveness thread would otherwise keep putting the "ready" beat from before the pause, and gateways
and routers would place requests the worker does not pull until it has verified itself."""

import asyncio
from types import SimpleNamespace

from services.worker.engine_watch import EngineWatch
from services.worker.liveness import PauseDetector


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeWorker(SimpleNamespace):
    """Just what the pause path touches: the engine answers only when the test lets it."""

    def __init__(self, clock: Clock) -> None:
        self.engine_up = asyncio.Event()
        self.beats_kept: list[str] = []  # the states the liveness thread was told to keep putting
        self.beats_put: list[str] = []  # the states put right away
        self.spawned: list[asyncio.Task[None]] = []
        self.watch: EngineWatch | None = None

        async def ready() -> bool:
            await self.engine_up.wait()
            return True

        async def setup_bus() -> None:
            return None

        async def publish_heartbeat() -> None:  # the worker's announce()
            self.beats_put.append(beat())

        def beat() -> str:
            assert self.watch is not None
            return "draining" if self.watch.holding_pulls else "ready"

        super().__init__(
            pause=PauseDetector(clock, pause_after_s=3.0), phase="serving", leaving=False, running={},
            engine=SimpleNamespace(ready=ready), setup_bus=setup_bus, forget_pulls=lambda: None,
            gpu=SimpleNamespace(worker_paused=lambda: None),
            refresh_beat=lambda: self.beats_kept.append(beat()), announce=publish_heartbeat,
            background=SimpleNamespace(spawn=lambda work: self.spawned.append(asyncio.ensure_future(work))),
            wake=asyncio.Event(), load_changed=asyncio.Event(),
        )


def test_a_resumed_worker_says_draining_before_its_loop_runs_again_and_ready_once_verified() -> None:
    async def scenario() -> None:
        clock = Clock()
        worker = FakeWorker(clock)
        watch = worker.watch = EngineWatch(worker)  # type: ignore[arg-type]
        clock.now += 8  # SIGSTOP for 8 s, then SIGCONT: the first tick sees the gap
        watch.tick()
        # Synchronously, before any other task runs: the liveness thread now keeps "draining".
        assert watch.holding_pulls
        assert worker.beats_kept == ["draining"]
        await asyncio.gather(*worker.spawned)
        assert worker.beats_put == ["draining"]
        worker.engine_up.set()  # verified: the engine answers, the consumers exist
        assert watch._verifying is not None
        await watch._verifying
        assert not watch.holding_pulls
        assert worker.beats_put == ["draining", "ready"]  # told at once, not at the next heartbeat

    asyncio.run(scenario())
