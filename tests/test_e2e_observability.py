"""What an operator sees: per-request JSON logs, one trace across the hops, Prometheus metrics."""

from __future__ import annotations

import json
import secrets
import time

import httpx
import openai
import pytest

from .conftest import MODEL, Platform

pytestmark = pytest.mark.e2e


def _wait_for_line(platform: Platform, log_names: list[str], needle: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in log_names:
            for line in platform.stack.get(name).log_path.read_text(errors="replace").splitlines():
                if needle in line:
                    return line
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in the logs of {log_names}")


def test_a_client_trace_reaches_the_engine_through_nats(platform: Platform, client: openai.OpenAI) -> None:
    trace_id = secrets.token_hex(16)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
    )
    line = _wait_for_line(platform, ["engine-1", "engine-2"], trace_id)
    assert "traceparent" in line


def test_each_request_leaves_one_json_access_log_line(platform: Platform, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "log me"}], max_tokens=3, stream=True
    )
    for _ in raw.parse():
        pass
    request_id = raw.headers["x-request-id"]
    record = json.loads(_wait_for_line(platform, ["gateway"], f'"request_id": "{request_id}"'))
    assert record["event"] == "request"
    assert record["tenant"] == "demo"
    assert record["status"] == 200 and record["stream"] is True
    assert record["completion_tokens"] == 3 and record["ttft_ms"] > 0
    # Admission (authentication, parsing, rendering, quotas) is timed apart: on a starved machine
    # it is where a request waits before the gateway's TTFT clock starts.
    assert 0 < record["admit_ms"] < 10_000
    assert record["worker"] in ("worker-1", "worker-2")


def test_prometheus_metrics_count_requests_and_tokens(platform: Platform, client: openai.OpenAI) -> None:
    def scrape() -> dict[str, float]:
        values: dict[str, float] = {}
        for line in httpx.get(platform.stack.gateway_url + "/metrics").text.splitlines():
            if line.startswith("inferbus_") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4)
    after = scrape()
    key = 'inferbus_requests_total{endpoint="completion",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert (
        after['inferbus_tokens_total{kind="completion"}'] - before.get('inferbus_tokens_total{kind="completion"}', 0)
        == 4
    )
    # Latency histograms are labelled by the model, adapter (base or lora) and band.
    ttft = [k for k in after if k.startswith("inferbus_ttft_seconds_count{") and f'model="{MODEL}"' in k
            and 'adapter="base"' in k]
    assert ttft and sum(after[k] - before.get(k, 0) for k in ttft) == 1
    assert "inferbus_inflight_requests" in after
