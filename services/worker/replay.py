"""The stream events a worker sent lately, to send again when a gateway missed some.

Core NATS does not redeliver: events in flight when a NATS node dies or a connection moves are
lost. The gateway notices a lost chunk from the next one's `seq`, or, when the lost ones were a
stream's last, from the stream's silence; either way it asks the worker holding the attempt to
send again from the first chunk it lacks. Sending them again keeps the client's text exactly what
the engine produced, where continuing the request on another worker would generate it anew.

Each attempt keeps its last `depth` events as they left (merged chunks included), and a finished
attempt is kept `keep_s` more: long enough for the gateway to notice the silence and ask. What is
older than that cannot be sent again, and the gateway continues the request elsewhere.

Pure: the events sender records what it publishes; the worker answers the gateways' requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from proto import messages as m
from proto import subjects

State = Literal["running", "finished", "unknown"]


@dataclass
class _Sent:
    subject: str
    attempt: int
    events: deque[m.StreamEvent]
    finished: bool = False


@dataclass
class ReplayLog:
    clock: Callable[[], float]
    keep_s: float = 10.0
    depth: int = 256
    _streams: dict[str, _Sent] = field(default_factory=dict)  # request id → its latest attempt's events
    # (when, request id, attempt) of attempts that ended, in that order: forgotten `keep_s` later
    _ended: deque[tuple[float, str, int]] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self._streams)

    def record(self, subject: str, events: Iterable[m.StreamEvent]) -> None:
        """`events` were published to `subject`, in this order."""
        streams = self._streams
        for event in events:
            if type(event) is m.Accepted:
                continue  # carries no output: the first chunk makes up for a lost one
            sent = streams.get(event.request_id)
            if sent is None or sent.attempt != event.attempt:
                sent = streams[event.request_id] = _Sent(subject, event.attempt, deque(maxlen=self.depth))
            sent.events.append(event)
            if type(event) is not m.TokenChunk and not sent.finished:  # Final, StreamError, Handoff
                sent.finished = True
                self._ended.append((self.clock(), event.request_id, event.attempt))
        self.expire()

    def ended(self, request_id: str, attempt: int) -> None:
        """The attempt stopped running, with or without a last event (a superseded one has none;
        its last events may still wait to be published): forget it `keep_s` from now."""
        sent = self._streams.get(request_id)
        if sent is not None and sent.attempt == attempt:
            if sent.finished:
                return
            sent.finished = True
        self._ended.append((self.clock(), request_id, attempt))

    def expire(self) -> None:
        """Forget attempts that ended more than `keep_s` ago."""
        ended, horizon = self._ended, self.clock() - self.keep_s
        while ended and ended[0][0] < horizon:
            _, request_id, attempt = ended.popleft()
            sent = self._streams.get(request_id)
            if sent is not None and sent.attempt == attempt:
                del self._streams[request_id]

    def since(self, request_id: str, attempt: int, from_seq: int, *, owner: str, running: bool
              ) -> tuple[State, str, list[m.StreamEvent]]:
        """The state of the attempt, the subject its events went to, and those from chunk
        `from_seq` on (with a last error or handoff, which has no `seq`). `owner`: the gateway
        token (`subjects.reply_owner`) that asks: another gateway's streams are unknown to it.
        `running`: whether the worker still generates the attempt (its events may all still wait
        for their frame). `unknown` when the attempt is not kept, or its events from `from_seq`
        are no longer all kept."""
        self.expire()
        sent = self._streams.get(request_id)
        if sent is None or sent.attempt != attempt:
            return ("running" if running else "unknown"), "", []
        if subjects.reply_owner(sent.subject) != owner:
            return "unknown", "", []
        events = sent.events
        first = next((e.seq for e in events if type(e) is m.TokenChunk or type(e) is m.Final), None)
        if first is not None and first > from_seq:
            return "unknown", sent.subject, []  # the chunks asked for fell out of the log
        again = [e for e in events if not (type(e) is m.TokenChunk or type(e) is m.Final) or e.seq >= from_seq]
        finished = sent.finished and not running
        return ("finished" if finished else "running"), sent.subject, again
