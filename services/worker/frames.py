"""Which stream events leave for a gateway together, and when: the worker's per-token decision.

Every event for one gateway waits in that gateway's pending frame, and the frame leaves as one
bus message. Frames leave at the end of the event-loop pass that made something urgent (a stream's
first token, an error, a handoff), otherwise when the oldest waiting event is `window_s` old: the
engine writes one step's tokens for all its streams at once, and they reach the worker over a few
loop passes, so a short window gathers a whole step into one message per gateway instead of one
per pass, while no stream's first token waits for it.

A stream's `Accepted` may wait longer (`accepted_wait_s`) for the stream's first token, so that
at low load, where nothing else is on its way to that gateway, the two leave as one message
instead of two a millisecond apart; under load some other stream's tokens take it along sooner.

A stream's tokens that arrive while its previous chunk is still waiting are merged into that chunk
(one TokenChunk, one `seq`), and a Final into the chunk before it: the gateway writes one HTTP
chunk per event, so a merged event also saves the client a write.

Pure: the service shell (`events_out`) owns the timer and the publishing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from proto import messages as m


def merge(pending: m.TokenChunk, later: m.TokenChunk | m.Final) -> m.TokenChunk | m.Final:
    """One event saying what `pending` and then `later` (of the same attempt) said: the text,
    ids and logprobs of both, `later`'s totals, `pending`'s place in the stream."""
    logprobs = None if pending.logprobs is None and later.logprobs is None else [
        *(pending.logprobs or ()), *(later.logprobs or ())]
    if isinstance(later, m.TokenChunk):
        return m.TokenChunk(
            request_id=pending.request_id, attempt=pending.attempt, seq=pending.seq, text=pending.text + later.text,
            completion_tokens=later.completion_tokens,
            prompt_tokens=pending.prompt_tokens if pending.prompt_tokens is not None else later.prompt_tokens,
            token_ids=[*pending.token_ids, *later.token_ids], logprobs=logprobs, worker_id=pending.worker_id,
        )
    return m.Final(
        request_id=later.request_id, attempt=later.attempt, seq=pending.seq, text=pending.text + later.text,
        finish_reason=later.finish_reason, usage=later.usage, matched_stop=later.matched_stop,
        worker_id=later.worker_id, token_ids=[*pending.token_ids, *later.token_ids], logprobs=logprobs,
    )


def urgent(event: m.StreamEvent) -> bool:
    """Whether `event` may not wait for the window: a stream's first output (its time to first
    token), and errors and handoffs, after which the gateway acts (migrates, answers)."""
    if isinstance(event, (m.TokenChunk, m.Final)):
        return event.seq == 0
    return isinstance(event, (m.StreamError, m.Handoff))


class PendingFrames:
    """Events waiting to leave, per reply subject, in order per request; merged where they can be."""

    def __init__(self, window_s: float, clock: Callable[[], float], accepted_wait_s: float | None = None) -> None:
        self.window_s = window_s
        self.accepted_wait_s = window_s if accepted_wait_s is None else max(window_s, accepted_wait_s)
        self.clock = clock
        self._frames: dict[str, list[m.StreamEvent]] = {}  # reply subject → events, in order
        # request id → (subject, index in its frame) of its last waiting event: a chunk there may take more
        self._last: dict[str, tuple[str, int]] = {}
        self._due_at: float | None = None  # when the waiting events must leave, at the latest
        self.urgent = False

    def __len__(self) -> int:
        return sum(len(events) for events in self._frames.values())

    def add(self, subject: str, event: m.StreamEvent) -> bool:
        """Queue `event` for `subject`; True when it was merged into the request's waiting chunk
        (the chunk keeps its `seq`: the caller's next chunk takes the number this one would have)."""
        due_at = self.clock() + (self.accepted_wait_s if isinstance(event, m.Accepted) else self.window_s)
        if self._due_at is None or due_at < self._due_at:
            self._due_at = due_at
        frame = self._frames.setdefault(subject, [])
        last = self._last.get(event.request_id)
        if last is not None and last[0] == subject and isinstance(event, (m.TokenChunk, m.Final)):
            pending = frame[last[1]]
            if isinstance(pending, m.TokenChunk) and pending.attempt == event.attempt:
                frame[last[1]] = merge(pending, event)
                return True
        self._last[event.request_id] = (subject, len(frame))
        frame.append(event)
        self.urgent = self.urgent or urgent(event)
        return False

    def due_at(self) -> float | None:
        """When the waiting events must leave, on `clock` (-inf: at the end of this loop pass);
        None when nothing waits."""
        if self._due_at is None:
            return None
        if self.urgent:
            return -math.inf
        return self._due_at

    def due_in(self) -> float | None:
        """Seconds until the waiting events must leave (0: at the end of this loop pass); None
        when nothing waits."""
        due_at = self.due_at()
        return None if due_at is None else max(0.0, due_at - self.clock())

    def take(self) -> dict[str, list[m.StreamEvent]]:
        """Everything waiting, per subject; the next event opens a new window."""
        frames, self._frames = self._frames, {}
        self._last.clear()
        self._due_at = None
        self.urgent = False
        return frames
