"""bench.lora's account of what its slowest requests waited for, on log lines as the services write
them."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from bench.lora import markdown, waits_of_the_slowest


def stamp(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z")


class Logs:
    """The platform's log lines by service, as `Platform.log_events` reads them."""

    def __init__(self, lines: dict[str, list[dict[str, Any]]]) -> None:
        self.lines = lines

    def log_events(self, name: str, event: str, since: float) -> list[dict[str, Any]]:
        return [line for line in self.lines.get(name, []) if line["event"] == event]


def test_the_slowest_requests_are_told_apart_by_the_loads_on_their_worker() -> None:
    t0 = 1_000_000.0
    records = []
    for i in range(100):  # fast requests of a hot adapter, spread over both workers
        records.append({"rank": 1, "class": "hot", "error": None, "at": t0 + i, "first_at": t0 + i + 0.05,
                        "ttft_s": 0.05, "id": f"r{i}"})
    records += [
        # a tail adapter's request that waited for its own load on worker-1
        {"rank": 300, "class": "tail", "error": None, "at": t0 + 10, "first_at": t0 + 10.5, "ttft_s": 0.5, "id": "own"},
        # a hot request on worker-1 while that load ran: the engine ran no batch
        {
            "rank": 1,
            "class": "hot",
            "error": None,
            "at": t0 + 10.1,
            "first_at": t0 + 10.45,
            "ttft_s": 0.35,
            "id": "stalled",
        },
        # a middle request on worker-2, slow for another reason
        {
            "rank": 20,
            "class": "middle",
            "error": None,
            "at": t0 + 50,
            "first_at": t0 + 50.3,
            "ttft_s": 0.3,
            "id": "other",
        },
    ]
    workers = {"own": "worker-1", "stalled": "worker-1", "other": "worker-2"}
    logs = Logs(
        {
            "gateway": [
                {"event": "request", "request_id": r["id"], "worker": workers.get(r["id"], f"worker-{1 + i % 2}")}
                for i, r in enumerate(records)
            ],
            "worker-1": [
                {
                    "event": "adapter_loaded",
                    "adapter": "ft-0300@sha256:1",
                    "load_s": 0.4,
                    "timestamp": stamp(t0 + 10.42),
                }
            ],
            "worker-2": [
                {"event": "adapter_loaded", "adapter": "ft-0007@sha256:1", "load_s": 0.4, "timestamp": stamp(t0 + 30)}
            ],
        }
    )
    slowest = waits_of_the_slowest(records, logs, 2, t0)  # type: ignore[arg-type]
    over_p90 = slowest["p90"]["by_class"]
    assert over_p90["tail"] == {"own load": 1, "other load": 0, "no load": 0}
    assert over_p90["hot"] == {"own load": 0, "other load": 1, "no load": 0}
    assert over_p90["middle"] == {"own load": 0, "other load": 0, "no load": 1}
    assert sum(sum(c.values()) for c in slowest["p99"]["by_class"].values()) == 1  # only the slowest


def test_the_report_shows_what_the_slowest_waited_for() -> None:
    slowest = {"p99": {"threshold_ms": 173.0, "by_class": {
        "hot": {"own load": 0, "other load": 2, "no load": 1},
        "middle": {"own load": 0, "other load": 0, "no load": 3},
        "tail": {"own load": 4, "other load": 1, "no load": 0}}}}
    run = {
        "requests": 10,
        "errors": 0,
        "imbalance": 1.0,
        "per_worker": {"worker-1": {"requests": 10, "loads": 1, "evictions": 0}},
        "ttft": {"p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0},
        "ttft_by_class": {c: {"p90_ms": 2.0, "p99_ms": 3.0} for c in ("hot", "middle", "tail")},
        "slowest": slowest,
    }
    results = {"inputs": {"workers": 1, "tenants": 1, "slots": 8, "rate_rps": 1.0, "share": 0.8, "capacity_rps": 1.25,
                          "goodput_rps": 1.25, "seconds": 1.0, "time_scale": 1.0, "machine": "test"},
               "at_200": {"adapters": 200, "registration_s": 0.1, "warmup": {"adapters": 1, "loads": 1, "wall_s": 1.0},
                          "lora": run},
               "verdicts": []}
    assert "| 200 adapters, adapters | over p99 (173 ms) | 0 / 0 / 4 | 2 / 0 / 1 | 1 / 3 / 0 |" in markdown(results)
