"""`inferbus mix from-usage`: a window of the usage ledger becomes a mix that plan/sweep/simulate read."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest
import yaml
from click.testing import CliRunner

from proto import messages as m
from proto import subjects
from tools.capacity import mix as mix_mod
from tools.capacity import usage_mix
from tools.commands.mix import from_usage, parse_when

from .conftest import Platform


def event(prompt: int, completion: int, cached: int = 0, *, finished: float = 1000.0, status: str = "completed",
          model: str = "llama", tenant: str = "t", batch_id: str | None = None) -> m.UsageEvent:
    return m.UsageEvent(
        request_id=uuid.uuid4().hex,
        tenant=tenant,
        model=model,
        status=status,  # type: ignore[arg-type]
        usage=m.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached),
        started=finished - 1,
        finished=finished,
        batch_id=batch_id,
    )


WINDOW = usage_mix.UsageFilter(start=0.0, end=2000.0)


def test_cells_keep_means_and_cached_share_by_hand() -> None:
    events = [
        event(600, 250, 360), event(700, 200, 420),  # in 512–1023 / out 128–255
        event(3000, 400, 1500),  # in 2048–4095 / out 256–511
        event(600, 250, status="cancelled"), event(600, 250, batch_id="batch_1"),
        event(600, 250, finished=5000.0),  # outside the window
        event(600, 250, model="other"),
    ]
    collected = usage_mix.collect(events, usage_mix.UsageFilter(start=0.0, end=2000.0, model="llama"))
    assert collected.counted == 3 and collected.skipped == {"cancelled": 1, "batch": 1}
    spec = usage_mix.to_spec(collected, "measured")
    assert spec["classes"] == [
        {"name": "in 512-1023 / out 128-255", "weight": 2, "input_tokens": 650, "output_tokens": 225,
         "cached_fraction": round(780 / 1300, 4)},
        {"name": "in 2048-4095 / out 256-511", "weight": 1, "input_tokens": 3000, "output_tokens": 400,
         "cached_fraction": 0.5},
    ]
    stats = mix_mod.from_spec(spec, source="usage").stats()
    # Means over requests: (650 × 2 + 3000) ÷ 3 = 1433.3 input, (225 × 2 + 400) ÷ 3 = 283.3 output.
    assert stats.input_tokens == pytest.approx(4300 / 3) and stats.output_tokens == pytest.approx(850 / 3)
    assert stats.cached_tokens == pytest.approx((780 + 1500) / 3, rel=1e-3)


def test_batch_lines_count_when_asked_and_an_empty_window_is_an_error() -> None:
    events = [event(600, 250, batch_id="batch_1")]
    assert usage_mix.collect(events, usage_mix.UsageFilter(0.0, 2000.0, include_batch=True)).counted == 1
    with pytest.raises(ValueError, match="no completed requests"):
        usage_mix.to_spec(usage_mix.collect(events, WINDOW), "empty")


def test_a_request_reported_twice_is_one_request_of_the_mix() -> None:
    """The ledger keeps each reporter's report of a request (a worker killed after writing its
    report and the attempt that finished the request both report it): the mix counts it once."""
    once = event(600, 250)
    again = msgspec.structs.replace(once, worker_id="worker-2", finished=once.finished + 1)
    collected = usage_mix.collect([once, again, event(600, 250)], WINDOW)
    assert collected.counted == 2 and collected.skipped == {"duplicate": 1}


def test_a_fully_cached_prompt_still_prefills_one_token() -> None:
    spec = usage_mix.to_spec(usage_mix.collect([event(64, 10, 64)], WINDOW), "cached")
    assert spec["classes"][0]["cached_fraction"] == round(63 / 64, 4)


def test_when_parses_spans_and_times() -> None:
    assert parse_when("90m", 10_000.0) == 10_000.0 - 5400
    assert parse_when("2d", 200_000.0) == 200_000.0 - 172_800
    assert parse_when("1700000000", 0.0) == 1_700_000_000.0
    assert parse_when("2026-01-01T00:00Z", 0.0) == 1_767_225_600.0
    with pytest.raises(ValueError):
        parse_when("yesterday", 0.0)


@pytest.mark.e2e
def test_from_usage_reads_the_ledger_window(platform: Platform, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Events published on the real USAGE stream come back as a mix that `inferbus plan` accepts."""
    import nats

    tenant = f"mix-{uuid.uuid4().hex[:8]}"
    now = time.time()
    events = [event(2000, 300, 1000, finished=now, tenant=tenant) for _ in range(3)]
    events.append(event(100, 20, finished=now, tenant=tenant, status="failed"))

    async def publish() -> None:
        nc = await nats.connect(platform.stack.nats_url)
        js = nc.jetstream()
        for e in events:
            await js.publish(
                subjects.usage_subject(tenant, subjects.USAGE_FROM_OWNER, "gw"),
                m.encode(e),
                headers={"Nats-Msg-Id": e.request_id},
            )
        await nc.close()

    asyncio.run(publish())
    out = tmp_path / "measured.yaml"
    result = CliRunner().invoke(from_usage, ["--since", "10m", "--tenant", tenant, "--out", str(out),
                                             "--nats-url", platform.stack.nats_url])
    assert result.exit_code == 0, result.output
    assert "3 requests in 1 classes" in result.output and "1 failed" in result.output
    spec = yaml.safe_load(out.read_text())
    assert spec["classes"] == [{"name": "in 1024-2047 / out 256-511", "weight": 3, "input_tokens": 2000,
                                "output_tokens": 300, "cached_fraction": 0.5}]
    from tools.commands.plan import plan

    planned = CliRunner().invoke(plan, ["--rps", "10", "--mix", str(out), "--tp", "2", "--gpu", "H100:2.5",
                                        "--no-compare"])
    assert planned.exit_code == 0, planned.output


@pytest.mark.slow
def test_from_usage_reports_an_unreachable_ledger() -> None:
    result = CliRunner().invoke(from_usage, ["--since", "1h", "--nats-url", "nats://127.0.0.1:1"])
    assert result.exit_code != 0 and "cannot reach NATS at nats://127.0.0.1:1" in result.output
