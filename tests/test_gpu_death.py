"""GPU death verdicts: hung (running, no progress), failing (errors in a row), down (too long); a
pause of the worker itself is not a hung engine."""

from types import SimpleNamespace

from services.worker.engine_watch import EngineWatch
from services.worker.gpu_death import GpuDeathDetector
from services.worker.liveness import PauseDetector


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def detector(clock: Clock) -> GpuDeathDetector:
    return GpuDeathDetector(clock, hang_after_s=10, down_after_s=30, max_errors=3)


def test_running_requests_without_progress_are_a_hang_and_idle_time_is_not() -> None:
    clock = Clock()
    gpu = detector(clock)
    clock.now += 100
    assert gpu.verdict(running=0, engine_down_since=None) is None  # idle for long: fine
    clock.now += 9
    assert gpu.verdict(running=2, engine_down_since=None) is None
    gpu.progress()
    clock.now += 9
    assert gpu.verdict(running=2, engine_down_since=None) is None
    clock.now += 2
    assert gpu.verdict(running=2, engine_down_since=None) == "engine_hung"


def test_errors_in_a_row_fail_the_engine_and_a_success_resets_them() -> None:
    clock = Clock()
    gpu = detector(clock)
    gpu.engine_error()
    gpu.engine_error()
    gpu.progress()
    gpu.engine_error()
    gpu.engine_error()
    assert gpu.verdict(running=0, engine_down_since=None) is None
    gpu.engine_error()
    assert gpu.verdict(running=0, engine_down_since=None) == "engine_failing"


def test_an_engine_down_too_long_is_given_up_and_zero_disables_each_rule() -> None:
    clock = Clock()
    gpu = detector(clock)
    down_since = clock.now
    clock.now += 29
    assert gpu.verdict(running=0, engine_down_since=down_since) is None
    clock.now += 2
    assert gpu.verdict(running=0, engine_down_since=down_since) == "engine_down"
    never = GpuDeathDetector(clock, hang_after_s=0, down_after_s=0, max_errors=0)
    for _ in range(10):
        never.engine_error()
    clock.now += 1000
    assert never.verdict(running=5, engine_down_since=0.0) is None


def test_a_pause_of_the_worker_itself_restarts_the_hang_clock_and_a_hang_after_it_still_counts() -> None:
    clock = Clock()
    gpu = detector(clock)
    worker = SimpleNamespace(pause=PauseDetector(clock, pause_after_s=3.0), gpu=gpu, phase="starting", leaving=False,
                             running={"r1": object(), "r2": object()})
    watch = EngineWatch(worker)  # type: ignore[arg-type]
    clock.now += 0.25
    watch.tick()
    clock.now += 12  # SIGSTOP: no tick, no token, for longer than the hang limit
    watch.tick()  # the tick loop notes the pause before it asks for a verdict
    assert gpu.verdict(running=2, engine_down_since=None) is None
    for _ in range(11):  # running again (ticking), and still no token: now it is the engine
        clock.now += 1
        watch.tick()
    assert gpu.verdict(running=2, engine_down_since=None) == "engine_hung"
