"""What the load generator records: one `RequestRecord` per request and a `ClientSample` of the
client's own behaviour per step (plain data, shared by `loadgen` and the pure `metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    kind: str
    start: float  # perf_counter when the request was sent
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with content
    end: float = 0.0  # last byte (or the failure)
    input_tokens: int | None = None  # server usage
    output_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None  # kind of failure, None when it completed
    error_message: str = ""
    scheduled: float | None = None  # open loop: when the arrival process wanted it sent


@dataclass(slots=True)
class ClientSample:
    """What the client itself did during a step."""

    wall_s: float
    cpu_s: float
    loop_lags_s: list[float]
    achieved_vs_target: float  # mean (in flight + thinking) / concurrency, or scheduled / actual dispatch span
    load_avg_1m: float | None = None
    # Closed loop: seconds from a request's end to its worker's next send (the client's re-issue delay).
    reissue_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepRun:
    records: list[RequestRecord]
    client: ClientSample
