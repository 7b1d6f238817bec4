"""Live per-role autoscaling: `inferbus up --prefill 1 --decode 1 --autoscale`'s stack (real
nats-server, Redis, every service as a process, the local actuator starting prefill and decode
engine+worker pairs) under a load ramp from the openai SDK. The pool whose capacity the load
exceeds grows (its role's replicas spawned and serving) and the other stays at its minimum; the
grown pool then scales back down once the load stops. Every decision is published on
`inferbus.scale.<model>:<role>`.

Which pool the load is too much for is set by the per-replica goodputs: 2 req/s for the pool that
must grow (a ramp to 6 req/s is worth three replicas), 50 req/s for the other. The other pool's
SLO budgets are generous, so that only a pool mixing up its signals or its goodput, or an actuator
starting the wrong role, could make it grow.
"""

from __future__ import annotations

import asyncio
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
from .test_e2e_autoscale import AUTOSCALER_ENV, _alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# The pool that must grow → the settings that make the load too much for it and not for the other.
SCENARIOS = {
    "decode": {"INFERBUS_AUTOSCALER_GOODPUT_RPS": "2", "INFERBUS_AUTOSCALER_PREFILL_GOODPUT_RPS": "50",
               # Generous prefill budgets: this test is about capacity and the actuator. A decode
               # shortage under the default budgets is test_autoscaler_roles.py's (the prefill
               # pool's TTFT starts at the decode worker's ask, after the wait for a decode slot).
               "INFERBUS_AUTOSCALER_PREFILL_TTFT_BUDGET_S": "30", "INFERBUS_AUTOSCALER_QUEUE_WAIT_BUDGET_S": "30"},
    "prefill": {"INFERBUS_AUTOSCALER_GOODPUT_RPS": "50", "INFERBUS_AUTOSCALER_PREFILL_GOODPUT_RPS": "2",
                "INFERBUS_AUTOSCALER_TPOT_SLO_S": "5", "INFERBUS_AUTOSCALER_DECODE_KV_BUDGET": "1"},
}


@pytest.mark.parametrize("grows", ["decode", "prefill"])
def test_the_pool_the_load_is_too_much_for_grows_and_the_other_does_not(tmp_path: Path, grows: str) -> None:
    other = "prefill" if grows == "decode" else "decode"
    grown_pool, other_pool = f"{MODEL}:{grows}", f"{MODEL}:{other}"
    with running_platform(tmp_path, time_scale=0.1, autoscale=True, prefill=1, decode=1, max_workers=3,
                          cold_start_s=1.0, warm_start_s=0.3,
                          autoscaler_env={**AUTOSCALER_ENV, **SCENARIOS[grows]}) as platform:
        log = tmp_path / "logs" / "autoscaler.log"

        async def run() -> tuple[list[m.ScaleDecision], int, list[m.ScaleDecision]]:
            nc = await nats.connect(platform.stack.nats_url)
            decisions: list[m.ScaleDecision] = []
            decoder = msgspec.msgpack.Decoder(m.ScaleDecision)

            async def on_decision(msg) -> None:  # type: ignore[no-untyped-def]
                decisions.append(decoder.decode(msg.data))

            await nc.subscribe(subjects.scale_wildcard(), cb=on_decision)
            _, ok = await ramp(platform, decisions, grown_pool, recent=8, give_up_s=60.0)
            during = list(decisions)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                recent = [d for d in decisions if d.pool == grown_pool][-3:]
                if recent and all(d.serving == 1 and d.desired_serving == 1 and d.warm == 0 for d in recent):
                    break
                await asyncio.sleep(0.5)
            await nc.close()
            return decisions, ok, during

        decisions, ok, during = asyncio.run(run())
        assert ok > 20, f"only {ok} requests succeeded"
        assert {d.pool for d in decisions} == {grown_pool, other_pool}
        grown = [d for d in during if d.pool == grown_pool]
        kept = [d for d in decisions if d.pool == other_pool]

        # The pool the load is too much for: up to three serving, its role's replicas started.
        ups = [d for d in grown if d.direction == "up"]
        assert ups and any(d.desired_serving == 3 for d in ups), [d.reason for d in grown[-5:]]
        # Sized with its own goodput (its queue may have asked first: that is its signal too).
        assert any("at 2 req/s each" in d.reason for d in ups), [d.reason for d in ups]
        assert max(d.serving for d in grown) == 3, [(d.serving, d.warm, d.starting) for d in grown[-10:]]
        started = log_events(log, "replica_started")
        assert {e["role"] for e in started if e["pool"] == grown_pool} == {grows}
        assert len([e for e in started if e["pool"] == grown_pool]) >= 3

        # The other pool saw the same requests and kept serving with its minimum, one worker (a
        # rising rate may give it a warm spare, never promoted).
        assert kept and all(d.desired_serving == 1 for d in kept), [d.reason for d in kept if d.desired_serving != 1][
            :3
        ]
        assert max(d.serving for d in kept) == 1 and not any(d.promote for d in kept)
        assert max(d.arrival_rate for d in kept) > 2, "the other pool's workers saw the load too"
        assert {e["role"] for e in started if e["pool"] == other_pool} == {other}

        # Down: the grown pool back to its minimum once the load stops, its idle replicas stopped.
        grown_after = [d for d in decisions if d.pool == grown_pool]
        downs = [d for d in grown_after if d.direction == "down"]
        assert downs and downs[-1].desired_serving == 1, [d.reason for d in grown_after[-5:]]
        assert (grown_after[-1].serving, grown_after[-1].desired_serving) == (1, 1), grown_after[-1].reason
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len([e for e in log_events(log, "replica_stopped")
                                                    if e["pool"] == grown_pool]) < 2:
            time.sleep(0.2)
        stopped = log_events(log, "replica_stopped")
        assert len([e for e in stopped if e["pool"] == grown_pool]) >= 2, stopped
        for event in started:
            if event["worker_id"] in {e["worker_id"] for e in stopped}:
                assert not _alive(event["worker_pid"]) and not _alive(event["engine_pid"])

        # Still served by the pair left after scaling down.
        reply = platform.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage and reply.usage.completion_tokens == 3
