"""Live autoscaling: `inferbus up --autoscale`'s stack (real nats-server, Redis, every service as a
process, the local actuator starting simulated workers) under a load ramp from the openai SDK.
Workers must scale up (processes spawned, serving), then back down once the load stops, with
every decision published on `inferbus.scale.<pool>`.

Windows are seconds instead of minutes (settings), and the configured per-replica goodput is
low (2 req/s), so that a ramp a test machine can drive is worth three replicas.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import nats
import pytest

from proto import messages as m
from proto import subjects

from .conftest import MODEL, running_platform
from .ramp import ramp
from .service_logs import log_events

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

AUTOSCALER_ENV = {
    "INFERBUS_AUTOSCALER_TICK_S": "0.5",
    "INFERBUS_AUTOSCALER_RATE_WINDOW_S": "4",
    "INFERBUS_AUTOSCALER_LATENCY_WINDOW_S": "6",
    "INFERBUS_AUTOSCALER_GOODPUT_RPS": "2",
    "INFERBUS_AUTOSCALER_SCALE_DOWN_WINDOW_S": "6",
    "INFERBUS_AUTOSCALER_DOWN_STEP_S": "1",
    "INFERBUS_AUTOSCALER_MAX_STEP_DOWN": "1",
    "INFERBUS_AUTOSCALER_SLO_COOLDOWN_S": "3",
    "INFERBUS_AUTOSCALER_PENDING_S": "10",
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_load_ramp_scales_workers_up_and_back_down(tmp_path: Path) -> None:
    with running_platform(tmp_path, workers=1, time_scale=0.1, autoscale=True, min_workers=1, max_workers=3,
                          cold_start_s=1.0, warm_start_s=0.3, autoscaler_env=AUTOSCALER_ENV) as platform:
        log = tmp_path / "logs" / "autoscaler.log"

        async def run() -> tuple[list[m.ScaleDecision], float, int, list[m.ScaleDecision]]:
            nc = await nats.connect(platform.stack.nats_url)
            decisions: list[m.ScaleDecision] = []
            decoder = msgspec.msgpack.Decoder(m.ScaleDecision)

            async def on_decision(msg) -> None:  # type: ignore[no-untyped-def]
                decisions.append(decoder.decode(msg.data))

            await nc.subscribe(subjects.scale_wildcard(), cb=on_decision)
            stopped, ok = await ramp(platform, decisions)
            during = list(decisions)
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline:
                recent = decisions[-3:]
                if recent and all(d.serving == 1 and d.desired_serving == 1 and d.warm == 0 for d in recent):
                    break
                await asyncio.sleep(0.5)
            await nc.close()
            return decisions, stopped, ok, during

        decisions, _, ok, during = asyncio.run(run())
        assert ok > 20, f"only {ok} requests succeeded"
        assert decisions and all(d.pool == MODEL and d.reason for d in decisions)

        # Up: a published decision with its reason and signals, then three workers serving.
        ups = [d for d in during if d.direction == "up"]
        assert ups, [d.reason for d in during[-5:]]
        assert any(d.desired_serving == 3 for d in ups), [d.reason for d in ups]
        assert ups[0].reason.startswith("scale up "), ups[0].reason
        assert "req/s" in ups[0].reason and ups[0].arrival_rate > 0
        assert max(d.serving for d in during) == 3, [(d.serving, d.warm, d.starting) for d in during[-10:]]
        started = log_events(log, "replica_started")
        assert {e["worker_id"] for e in started} >= {"worker-1", "worker-2", "worker-3"}

        # Down: a slow scale-down (after the window) back to the minimum; idle replicas stopped.
        downs = [d for d in decisions if d.direction == "down"]
        assert downs and downs[-1].desired_serving == 1, [d.reason for d in decisions[-5:]]
        assert "low load" in downs[0].reason
        final = decisions[-1]
        assert (final.serving, final.desired_serving) == (1, 1), final.reason
        assert any(d.demote for d in decisions)
        # Stopping is a drain then SIGTERM to worker and engine: quick, except on a loaded machine.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(log_events(log, "replica_stopped")) < 2:
            time.sleep(0.2)
        stopped = {e["worker_id"] for e in log_events(log, "replica_stopped")}
        assert len(stopped) >= 2, stopped
        for event in started:
            if event["worker_id"] in stopped:
                assert not _alive(event["worker_pid"]) and not _alive(event["engine_pid"])

        # Still serving after scaling down.
        reply = platform.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage and reply.usage.completion_tokens == 3
