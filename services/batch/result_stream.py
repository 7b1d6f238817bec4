"""The batch service's side of the `BATCH_RESULTS` stream: follow a batch's results (replayed from
the start, then live), judge the workers' ones, record those taken (and those a line ends with in
the service) on the service's own subject, and read every line's first result back for the output
files.

Whose result counts is `results`' call (pure), and the state it reads and writes is the
`tracker`'s; this is the shell that subscribes, publishes and logs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from inferbus.bus import security_events
from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

from . import results as line_results
from .metrics import RESULTS

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from inferbus.bus.replies import Replies

    from .tracker import ActiveBatch, Tracker

log = logs.get(__name__)

_result_decoder = msgspec.msgpack.Decoder(m.BatchLineResult)


class Following(Protocol):
    """What the results stream may touch of the batch service: its id (its own result subject), the
    bus, and the lines it tracks."""

    @property
    def id(self) -> str: ...
    @property
    def js(self) -> JetStreamContext | None: ...
    @property
    def replies(self) -> Replies | None: ...
    @property
    def tracker(self) -> Tracker: ...


class ResultStream:
    def __init__(self, service: Following) -> None:
        self.service = service
        self._subscriptions: dict[str, JetStreamContext.PushSubscription] = {}  # batch id → its live results

    async def last_seq(self, filter_subject: str) -> int:
        js = self.service.js
        assert js is not None
        try:
            last = await js.get_last_msg(subjects.BATCH_RESULTS_STREAM, filter_subject)
        except NotFoundError:
            return 0
        return int(last.seq or 0)

    async def follow(self, run: ActiveBatch) -> None:
        """Replay the batch's results from the start of the stream, then follow new ones; the run
        may feed once the replay has reached where the stream stood. The results this service
        recorded (`o`) count, first per line; a worker's (`w`) is judged (`judge`), once the
        replay is over (a worker's result replayed may have been recorded since)."""
        js, tracker = self.service.js, self.service.tracker
        assert js is not None
        last = await self.last_seq(subjects.batch_results_filter(run.id))
        run.loaded = run.loaded or last == 0

        reached = last == 0  # this subscription's replay reached where the stream stood
        unjudged: list[tuple[tuple[str, str] | None, m.BatchLineResult]] = []  # workers' results replayed

        async def on_result(msg: Msg) -> None:
            nonlocal reached
            seq = msg.metadata.sequence.stream
            sender = subjects.batch_result_sender(msg.subject)
            try:
                result: m.BatchLineResult | None = _result_decoder.decode(msg.data)
            except msgspec.DecodeError as error:
                log.warning("bad_batch_result", error=str(error), subject=msg.subject)
                result = None
            if result is None:
                pass
            elif sender is not None and sender[0] == subjects.RESULT_FROM_OWNER:
                if result.batch_id != run.id:
                    log.warning("batch_result_of_another_batch", subject=msg.subject, request_id=result.request_id)
                elif tracker.on_result(result):
                    RESULTS.labels("ok" if result.ok else (result.error_code or "error")).inc()
                elif reached:  # (a replay sees again what was counted, or logged, before)
                    log.info("batch_result_duplicate", request_id=result.request_id, attempt=result.attempt,
                             worker_id=result.worker_id, seq=seq)
            elif seq in run.judged:
                pass  # judged before this subscription (a replay after a reconnect): once is enough
            elif reached:
                run.judged.add(seq)
                await self.judge(run, sender, result)
            else:
                run.judged.add(seq)
                unjudged.append((sender, result))
            if not reached and seq >= last:
                reached = True
                if not run.loaded:
                    run.loaded = True
                    log.info("batch_results_replayed", batch_id=run.id, done=len(run.done), total=run.total)
                for replayed_sender, replayed in unjudged:
                    await self.judge(run, replayed_sender, replayed, replayed=True)
                unjudged.clear()

        # Always from the start of the stream, also when resubscribing after a reconnect: a NATS
        # server killed hard can lose its last writes and reuse their sequence numbers, so "after
        # the last one seen" could skip new results. Results seen twice are ignored by the tracker.
        self._subscriptions[run.id] = await js.subscribe(
            subjects.batch_results_filter(run.id), stream=subjects.BATCH_RESULTS_STREAM, ordered_consumer=True,
            cb=on_result,
        )

    async def unfollow(self, batch_id: str) -> None:
        """Stop following the batch's results (it is over, or its subscription is started again)."""
        subscription = self._subscriptions.pop(batch_id, None)
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def judge(self, run: ActiveBatch, sender: tuple[str, str] | None, result: m.BatchLineResult,
                    replayed: bool = False) -> None:
        """A worker's result: recorded as the line's when it comes from the attempt's holder
        (`results`), refused as a security event when only a forgery explains it. A `replayed`
        one that is a duplicate was logged when it came."""
        tracker = self.service.tracker
        holder = tracker.holder(run.id, result.line, result.attempt)
        why = tracker.judge(run, sender, result, holder)
        if why == line_results.TAKE:
            try:
                await self.publish(result)
            except Exception as error:  # the line's lease sends it out again
                tracker.not_recorded(run, result.line)
                log.warning("batch_result_not_recorded", request_id=result.request_id, error=repr(error))
        elif line_results.refused(why):
            security_events.record(line_results.FOREIGN_BATCH_RESULT, why=why, seen_in="result",
                                   request_id=result.request_id, attempt=result.attempt,
                                   publisher=sender[1] if sender else "", worker_named=result.worker_id, holder=holder)
        elif why == line_results.DUPLICATE:
            if not replayed:
                log.info("batch_result_duplicate", request_id=result.request_id, attempt=result.attempt,
                         worker_id=result.worker_id)
        else:  # judged once the attempt's `Accepted` comes, if ever (else the line runs again)
            log.info("batch_result_waits_for_holder", request_id=result.request_id, attempt=result.attempt,
                     worker_id=result.worker_id)

    async def read(self, batch_id: str) -> dict[int, m.BatchLineResult]:
        """Every line's first recorded result, read back from the stream (for the output files)."""
        js = self.service.js
        assert js is not None
        kept = subjects.batch_results_kept_filter(batch_id)
        last = await self.last_seq(kept)
        found: dict[int, m.BatchLineResult] = {}
        if last == 0:
            return found
        sub = await js.subscribe(kept, stream=subjects.BATCH_RESULTS_STREAM, ordered_consumer=True)
        try:
            while True:
                msg = await sub.next_msg(timeout=10)
                try:
                    result = _result_decoder.decode(msg.data)
                except msgspec.DecodeError:
                    result = None
                if result is not None and result.batch_id == batch_id:
                    found.setdefault(result.line, result)
                if msg.metadata.sequence.stream >= last:
                    return found
        finally:
            await sub.unsubscribe()

    async def publish(self, result: m.BatchLineResult) -> None:
        """Record a line's result (a worker's, taken; or one the line ends with here, refused before
        running) on this service's own subject, where readers count it. Its message id has a fresh
        nonce: no one else's publish can have it dropped (a record published twice, the first
        one counts)."""
        replies = self.service.replies
        assert replies is not None
        me = f"batch-{self.service.id}"
        await replies.publish_durable(
            subjects.batch_result_subject(result.batch_id, subjects.RESULT_FROM_OWNER, me), m.encode(result),
            m.batch_result_publish_id(result, f"{subjects.RESULT_FROM_OWNER}.{subjects.token(me)}",
                                      m.new_usage_nonce()))
