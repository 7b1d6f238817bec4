"""In-memory state of the batches being run, rebuilt from the durable stores on start. Pure.

Per batch: which lines have a result (the first one the batch service recorded per line wins;
later ones are duplicates of a line that ran twice), which are out in the fleet (attempt, owner
worker once a worker accepted it, since when), who holds each attempt (`results`: only its
holder's result is taken), which still wait to be published, and the counters and usage the
record shows.

Lines are handed out fairly: tenants take turns line by line, and within a tenant its oldest
batch goes first. A line goes out again (next attempt) when its owner's heartbeat ends, or when
it has had no result for a whole lease (lost without a trace: a worker that died before
accepting it, a dropped `Accepted`).

After a restart nothing says which lines the previous run had published. Every line without a
result is then "in doubt": the shell publishes it with attempt 0 and, if JetStream's dedup says
that id was published in the last two minutes, with the next attempts until one is new. A line
that was still running on a live worker then runs twice: the first result wins and the usage
event, deduplicated by request id, bills it once. Nothing is lost; at most the lines in flight at
the restart are computed twice, on spare capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from proto import messages as m

from .results import NOT_HELD, TAKE, accepted_refusal, verdict


@dataclass
class Outstanding:
    attempt: int
    since: float  # when it was published, or last accepted by a worker
    worker_id: str | None = None  # who runs it, once `Accepted` says so


@dataclass
class ActiveBatch:
    record: m.BatchRecord
    custom_ids: list[str]
    offsets: list[int]  # byte offset of each request's line in the input file
    base_model: str
    adapter: str | None = None
    input_path: str = ""  # where the input file's bytes are
    done: dict[int, bool] = field(default_factory=dict)  # line → ok
    outstanding: dict[int, Outstanding] = field(default_factory=dict)
    pending: deque[int] = field(default_factory=deque)  # never published (or in doubt), in line order
    retry: deque[tuple[int, int]] = field(default_factory=deque)  # (line, attempt) to publish again first
    doubt: set[int] = field(default_factory=set)
    # (line, attempt) → the worker (subject token) whose `Accepted` made it the attempt's holder
    holders: dict[tuple[int, int], str] = field(default_factory=dict)
    recording: set[int] = field(default_factory=set)  # lines whose taken result is being recorded
    judged: set[int] = field(default_factory=set)  # stream sequences of the workers' results judged
    blind: set[int] = field(default_factory=set)  # lines whose `Accepted` this process may have missed
    # (line, attempt) → workers' results of an attempt nobody is known to hold yet (its `Accepted`
    # may come after the result: another path), judged when it comes
    waiting: dict[tuple[int, int], list[tuple[tuple[str, str] | None, m.BatchLineResult]]] = field(default_factory=dict)
    usage: m.BatchUsage = field(default_factory=m.BatchUsage)
    completed: int = 0
    failed: int = 0
    feeding: bool = True  # False once cancelling or expiring: nothing more goes out
    finishing: str | None = None  # the final status being written: completed or expired
    loaded: bool = False  # the results stream has been replayed up to where it stood at start
    dirty: bool = False  # counters changed since the record was last written

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def tenant(self) -> str:
        return self.record.tenant

    @property
    def total(self) -> int:
        return len(self.custom_ids)

    def finished(self) -> bool:
        return len(self.done) >= self.total


WAITING_PER_LINE = 2  # results waiting for their attempt's holder, at most, per line of a batch
MAX_DOUBT_ATTEMPTS = 5  # a line in doubt after a restart: attempt ids tried before giving up on dedup


def publishes_next_attempt(*, stored: bool, doubt: bool, attempt: int) -> bool:
    """Whether a line whose `attempt` was just published goes out again as its next attempt: a line
    in doubt after a restart whose attempt id JetStream's dedup dropped (published in the last
    minutes, it may have died with a worker; the first result wins), up to MAX_DOUBT_ATTEMPTS ids."""
    return not stored and doubt and attempt + 1 < MAX_DOUBT_ATTEMPTS


def parse_request_id(request_id: str) -> tuple[str, int] | None:
    """(batch id, line) of a batch line's request id (`batch_request_id`), else None."""
    batch_id, sep, line = request_id.rpartition("-")
    if not sep or not line.isdigit() or not batch_id.startswith("batch_"):
        return None
    return batch_id, int(line)


class Tracker:
    def __init__(self, line_lease_s: float) -> None:
        self.line_lease_s = line_lease_s
        self.runs: dict[str, ActiveBatch] = {}
        self._turn: deque[str] = deque()  # tenants in the order they get their next line

    # ---- batches --------------------------------------------------------------------------

    def add(self, run: ActiveBatch, *, resumed: bool) -> None:
        """Track a batch; `resumed`: it was in progress before this process started (its lines
        without a result are in doubt). Lines with results already in `run.done` are skipped."""
        self.runs[run.id] = run
        todo = [line for line in range(run.total) if line not in run.done]
        run.pending = deque(todo)
        if resumed:
            run.doubt = set(todo)
            run.blind = set(todo)
        if run.tenant not in self._turn:
            self._turn.append(run.tenant)

    def remove(self, batch_id: str) -> ActiveBatch | None:
        run = self.runs.pop(batch_id, None)
        if run is not None and not any(r.tenant == run.tenant for r in self.runs.values()):
            self._turn = deque(t for t in self._turn if t != run.tenant)
        return run

    def stop_feeding(self, batch_id: str) -> list[tuple[int, Outstanding]]:
        """No more lines of this batch go out; returns the lines out in the fleet (to cancel)."""
        run = self.runs[batch_id]
        run.feeding = False
        run.pending.clear()
        run.retry.clear()
        return sorted(run.outstanding.items())

    def reopen(self, batch_id: str, results: list[m.BatchLineResult], missing: list[int]) -> None:
        """Start over from `results` (the durable ones): counts are rebuilt from them and the
        `missing` lines, counted before but without a durable result, go out again (in doubt)."""
        run = self.runs[batch_id]
        run.done.clear()
        run.outstanding.clear()
        run.completed = run.failed = 0
        run.usage = m.BatchUsage()
        run.feeding, run.finishing = True, None
        for result in results:
            self.on_result(result)
        run.pending = deque(line for line in missing if line not in run.done)
        run.doubt = set(run.pending)
        run.blind |= run.doubt
        run.retry.clear()
        run.dirty = True

    # ---- events ---------------------------------------------------------------------------

    def on_result(self, result: m.BatchLineResult) -> bool:
        """Count a line's result; False when it is a duplicate or for no tracked batch."""
        run = self.runs.get(result.batch_id)
        if run is None or not 0 <= result.line < run.total or result.line in run.done:
            return False
        run.done[result.line] = result.ok
        run.outstanding.pop(result.line, None)
        run.recording.discard(result.line)
        run.doubt.discard(result.line)
        if result.ok:
            run.completed += 1
        else:
            run.failed += 1
        if result.usage is not None:
            run.usage = m.BatchUsage(
                input_tokens=run.usage.input_tokens + result.usage.prompt_tokens,
                cached_tokens=run.usage.cached_tokens + result.usage.cached_tokens,
                output_tokens=run.usage.output_tokens + result.usage.completion_tokens,
            )
        run.dirty = True
        return True

    def on_accepted(self, accepted: m.Accepted, now: float, sender: str,
                    alive: Callable[[str], bool] = lambda worker: True) -> str | None:
        """A worker (`sender`, the token its event's subject names) took a line: it holds the
        attempt now (`results.accepted_refusal`, `alive` tells whether a worker token still
        heartbeats) and owns the line (the newest attempt's owner counts). Returns why the event
        is refused (None: taken, or for no tracked line)."""
        parsed = parse_request_id(accepted.request_id)
        run = self.runs.get(parsed[0]) if parsed else None
        if run is None or parsed is None:
            return None
        key = (parsed[1], accepted.attempt)
        holder = run.holders.get(key)
        why = accepted_refusal(sender, accepted, holder, holder is not None and alive(holder))
        if why is not None:
            return why
        run.holders[key] = sender  # kept once the line is done: a late forgery is still refused
        if parsed[1] not in run.done:
            self._owned(run, parsed[1], accepted, now)
        return None

    def released(self, accepted: m.Accepted) -> list[tuple[ActiveBatch, tuple[str, str] | None, m.BatchLineResult]]:
        """The results that waited for the holder of `accepted`'s attempt (now known), to judge."""
        parsed = parse_request_id(accepted.request_id)
        run = self.runs.get(parsed[0]) if parsed else None
        if run is None or parsed is None:
            return []
        return [(run, sender, result) for sender, result in run.waiting.pop((parsed[1], accepted.attempt), [])]

    def holder(self, batch_id: str, line: int, attempt: int) -> str | None:
        """The worker token holding a line's attempt, as its `Accepted` said (None: not known)."""
        run = self.runs.get(batch_id)
        return run.holders.get((line, attempt)) if run is not None else None

    def judge(self, run: ActiveBatch, sender: tuple[str, str] | None, result: m.BatchLineResult,
              holder: str | None) -> str:
        """`results.verdict` on a worker's result of `run`; a result taken is now being recorded
        (a second one of the line meanwhile is a duplicate)."""
        done = result.line in run.done or result.line in run.recording
        why = verdict(sender, result, run.id, holder, done, blind=result.line in run.blind)
        if why == TAKE:
            run.recording.add(result.line)
        elif why == NOT_HELD and sum(map(len, run.waiting.values())) < WAITING_PER_LINE * run.total:
            # (Bounded: results no `Accepted` ever claims, forged ones say, cannot fill the memory.)
            run.waiting.setdefault((result.line, result.attempt), []).append((sender, result))
        return why

    def lost_sight(self) -> list[tuple[ActiveBatch, tuple[str, str] | None, m.BatchLineResult]]:
        """This service was disconnected from NATS: `Accepted` events of the lines not done may be
        lost. Those lines are blind from now on; the results waiting for a holder are returned,
        to judge again."""
        out: list[tuple[ActiveBatch, tuple[str, str] | None, m.BatchLineResult]] = []
        for run in self.runs.values():
            run.blind |= {line for line in range(run.total) if line not in run.done}
            for waiting in run.waiting.values():
                out.extend((run, sender, result) for sender, result in waiting)
            run.waiting.clear()
        return out

    def not_recorded(self, run: ActiveBatch, line: int) -> None:
        """Recording a taken result failed: the line waits for another (its lease sends it out again)."""
        run.recording.discard(line)

    def _owned(self, run: ActiveBatch, line: int, accepted: m.Accepted, now: float) -> None:
        entry = run.outstanding.get(line)
        if entry is None:
            if not run.feeding:
                return
            # A requeue by a worker (preemption) of a line we had given up on: it is out again.
            self._forget_pending(run, line)
            run.outstanding[line] = Outstanding(accepted.attempt, now, accepted.worker_id)
            return
        if accepted.attempt >= entry.attempt:
            entry.attempt, entry.since, entry.worker_id = accepted.attempt, now, accepted.worker_id

    def worker_gone(self, worker_id: str) -> int:
        """The worker's heartbeat ended: its lines go out again as their next attempt."""
        moved = 0
        for run in self.runs.values():
            if not run.feeding:
                continue  # cancelling or expiring: nothing goes out again (the grace period ends it)
            for line, entry in list(run.outstanding.items()):
                if entry.worker_id == worker_id:
                    del run.outstanding[line]
                    run.retry.append((line, entry.attempt + 1))
                    moved += 1
        return moved

    def expire_leases(self, now: float) -> int:
        """Lines without a result for a whole lease go out again. A result taken whose record has
        not come back by then is given up too (a NATS server killed hard loses its last writes,
        acknowledged ones included): the line's next result is taken, or the line would wait
        forever, its every result a duplicate of one nobody can read."""
        moved = 0
        for run in self.runs.values():
            if not run.feeding:
                continue
            for line, entry in list(run.outstanding.items()):
                if now - entry.since >= self.line_lease_s:
                    del run.outstanding[line]
                    run.recording.discard(line)
                    run.retry.append((line, entry.attempt + 1))
                    moved += 1
        return moved

    # ---- feeding --------------------------------------------------------------------------

    def outstanding(self) -> int:
        return sum(len(run.outstanding) for run in self.runs.values())

    def waiting(self) -> int:
        """Lines that could go out now."""
        return sum(len(run.pending) + len(run.retry) for run in self.runs.values() if run.feeding and run.loaded)

    def take(self, count: int, now: float) -> list[tuple[ActiveBatch, int, int, bool]]:
        """Up to `count` lines to publish now, fairly: (batch, line, attempt, in doubt). They count
        as outstanding from now on; `published` records what the bus actually did."""
        out: list[tuple[ActiveBatch, int, int, bool]] = []
        while len(out) < count:
            progressed = False
            for _ in range(len(self._turn)):
                tenant = self._turn[0]
                self._turn.rotate(-1)
                picked = self._next_of(tenant)
                if picked is None:
                    continue
                run, line, attempt = picked
                doubt = line in run.doubt
                run.doubt.discard(line)
                run.outstanding[line] = Outstanding(attempt, now)
                out.append((run, line, attempt, doubt))
                progressed = True
                if len(out) >= count:
                    break
            if not progressed:
                break
        return out

    def published(self, run: ActiveBatch, line: int, attempt: int) -> None:
        """The line went out as `attempt` (a line in doubt may have needed a later one)."""
        entry = run.outstanding.get(line)
        if entry is not None:
            entry.attempt = max(entry.attempt, attempt)

    def unpublished(self, run: ActiveBatch, line: int, attempt: int) -> None:
        """Publishing failed: the line goes back to the front, to be tried again."""
        if run.outstanding.pop(line, None) is not None and run.feeding and line not in run.done:
            run.retry.appendleft((line, attempt))

    def _next_of(self, tenant: str) -> tuple[ActiveBatch, int, int] | None:
        runs = sorted((r for r in self.runs.values() if r.tenant == tenant and r.feeding and r.loaded),
                      key=lambda r: (r.record.created_at, r.id))
        for run in runs:
            while run.retry:
                line, attempt = run.retry.popleft()
                if line not in run.done and line not in run.outstanding:
                    return run, line, attempt
            while run.pending:
                line = run.pending.popleft()
                if line not in run.done and line not in run.outstanding:
                    return run, line, 0
        return None

    @staticmethod
    def _forget_pending(run: ActiveBatch, line: int) -> None:
        if line in run.pending:
            run.pending.remove(line)
        run.retry = deque(item for item in run.retry if item[0] != line)

    def batches(self) -> Iterable[ActiveBatch]:
        return list(self.runs.values())
