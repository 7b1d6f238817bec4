"""A drill's outcome from what the clients saw and what the usage ledger holds. Pure.

Each client request is one `Call`: the status it ended with after the client's own retries (HTTP
status; 0 for a connection that broke or never opened), the request ids of its attempts, and the
usage the gateway reported to the client. The ledger is the tenant usage events on the `USAGE`
stream. A request the platform accepted and answered must have exactly one tenant event whose
tokens are what the client was told; an attempt that failed may have one (what the client
received) or none (refused before it was accepted), never two.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ERROR_BUDGET = 0.001  # the SLO: fewer than 0.1% of requests end in a 5xx


@dataclass
class Attempt:
    request_id: str  # the gateway's x-request-id ("" when no gateway answered)
    status: int  # HTTP status; 0: the connection failed or broke mid-stream
    started: float
    finished: float
    completion_tokens: int | None = None  # the usage the client received with a complete answer
    prompt_tokens: int | None = None
    retry_after: float = 0.0  # the server's Retry-After, when it sent one


@dataclass
class Call:
    """One client request, with every attempt the client made for it (its own retries)."""

    attempts: list[Attempt] = field(default_factory=list)
    cancelled: bool = False  # the client gave it up itself (excluded from the error ratio)

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def ok(self) -> bool:
        return self.final.status == 200 and self.final.completion_tokens is not None


@dataclass(frozen=True)
class LedgerEvent:
    request_id: str
    completion_tokens: int
    prompt_tokens: int
    status: str
    reporter: str = ""  # who reported it: the sender its subject names (`w.<worker>`, `o.<gateway>`)


@dataclass
class DrillReport:
    kind: str
    sent: int
    completed: int
    failed_by_status: dict[str, int]
    retried: int  # requests that needed more than one attempt
    error_ratio: float  # 5xx (and broken connections) after retries, over requests not cancelled by the client
    migrated: int  # streams continued on another worker (the gateways' inferbus_migrations_total)
    in_flight_at_fault: int | None  # requests the broken workers' engines held when it broke (None: not measured)
    usage_lost: int  # answered requests without their tenant usage event
    usage_duplicated: int  # request ids one reporter reported twice (see `compare_ledger`)
    usage_mismatched: int  # answered requests whose event's tokens differ from what the client was told
    fault_at: float  # seconds from the start of the load
    recovered_after_s: float | None  # from the fault until the platform served normally again
    recovery: str = ""  # what "recovered" was measured by
    notes: list[str] = field(default_factory=list)

    @property
    def within_budget(self) -> bool:
        return self.error_ratio < ERROR_BUDGET

    def ok(self, max_recovery_s: float) -> bool:
        return (self.within_budget and not self.usage_lost and not self.usage_duplicated and not self.usage_mismatched
                and self.recovered_after_s is not None and self.recovered_after_s <= max_recovery_s)

    def lines(self) -> list[str]:
        failed = ", ".join(f"{status}: {count}" for status, count in sorted(self.failed_by_status.items())) or "none"
        recovered = f"{self.recovered_after_s:.1f} s" if self.recovered_after_s is not None else "not recovered"
        return [
            f"drill {self.kind}: fault at {self.fault_at:.1f} s into the load",
            f"  requests sent      {self.sent}",
            f"  completed          {self.completed}",
            f"  failed by status   {failed}",
            f"  needed a retry     {self.retried}",
            (f"  5xx ratio          {self.error_ratio:.3%} (budget {ERROR_BUDGET:.1%}: "
             f"{'within' if self.within_budget else 'OVER'})"),
            f"  streams migrated   {self.migrated}",
            *([f"  live work hit      {self.in_flight_at_fault} requests on the broken workers' engines"]
              if self.in_flight_at_fault is not None else []),
            (f"  usage events       lost {self.usage_lost}, duplicated {self.usage_duplicated}, "
             f"tokens differ {self.usage_mismatched}"),
            f"  time to recover    {recovered}" + (f" ({self.recovery})" if self.recovery else ""),
            *[f"  note: {note}" for note in self.notes],
        ]


def is_server_error(status: int) -> bool:
    return status == 0 or status >= 500


def compare_ledger(calls: list[Call], ledger: list[LedgerEvent]) -> tuple[int, int, int]:
    """(lost, duplicated, mismatched) usage events of `calls` against the ledger, which the
    rollups read as they do: a request's tenant event counts once, the first stored. Two reporters
    may each report one request (a worker killed with its usage still in its outbox, delivered when
    it comes back, and the worker that finished the stream; their message ids differ): that is one
    bill. The same reporter twice is a duplicate: its retries share a message id, which JetStream
    drops."""
    by_id: dict[str, list[LedgerEvent]] = {}
    for event in ledger:
        by_id.setdefault(event.request_id, []).append(event)
    lost = duplicated = mismatched = 0
    for call in calls:
        for attempt in call.attempts:
            if not attempt.request_id:
                continue
            events = by_id.get(attempt.request_id, [])
            reporters = [e.reporter for e in events]
            if len(set(reporters)) < len(reporters):
                duplicated += 1
            if attempt is call.final and call.ok:
                if not events:
                    lost += 1
                elif events[0].completion_tokens != attempt.completion_tokens:
                    mismatched += 1
    return lost, duplicated, mismatched


def recovered_after(calls: list[Call], fault_at: float, ready_at: float | None) -> float | None:
    """Seconds from the fault until service was restored: the platform reported every part back
    (`ready_at`) and every request started from then on succeeded on its first attempt."""
    if ready_at is None:
        return None
    troubled = [a.started for call in calls for a in call.attempts[:1]
                if a.started >= fault_at and (len(call.attempts) > 1 or not call.ok) and not call.cancelled]
    last_trouble = max(troubled, default=fault_at)
    return max(ready_at, last_trouble) - fault_at


def summarize(kind: str, calls: list[Call], ledger: list[LedgerEvent], *, fault_at: float, ready_at: float | None,
              migrated: int, in_flight_at_fault: int | None = None, recovery: str = "",
              notes: list[str] | None = None) -> DrillReport:
    counted = [call for call in calls if not call.cancelled]
    failed = Counter(str(call.final.status or "connection") for call in counted if not call.ok)
    errors = sum(1 for call in counted if not call.ok and is_server_error(call.final.status))
    lost, duplicated, mismatched = compare_ledger(calls, ledger)
    return DrillReport(
        kind=kind, sent=len(calls), completed=sum(1 for call in calls if call.ok), failed_by_status=dict(failed),
        retried=sum(1 for call in calls if len(call.attempts) > 1),
        error_ratio=errors / len(counted) if counted else 0.0, migrated=migrated, in_flight_at_fault=in_flight_at_fault,
        usage_lost=lost, usage_duplicated=duplicated, usage_mismatched=mismatched, fault_at=fault_at,
        recovered_after_s=recovered_after(calls, fault_at, ready_at), recovery=recovery, notes=list(notes or []),
    )
