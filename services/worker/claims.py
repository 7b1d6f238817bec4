"""One run per request attempt, however many times JetStream delivers it.

A message is delivered again when its ack did not reach the server within `ack_wait` (a starved
worker, a lost ack) or when the stream holds a second copy (a publish retried after the
deduplication window). Without a claim both deliveries reach an engine: on one worker the engine
refuses the duplicate id and the client got a 4xx for a platform fault; on two, the work runs twice.

So before a worker runs an attempt it creates the attempt's key in the `claims` bucket (atomic:
only one create succeeds). A delivery that finds the key is absorbed (acked, nothing sent to
anyone), unless the claim's holder is gone, which means the first delivery died with its
worker before it started: then the claim is taken over and the attempt runs here.

`verdict` is the decision, pure; `Claims` is the shell around the bucket.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

Verdict = Literal["run", "absorb", "take_over"]
_beat_decoder = msgspec.msgpack.Decoder(m.Heartbeat)


def holder_name(worker_id: str, started: float) -> str:
    """Who holds a claim: a worker process (a restarted worker under the same id is another one)."""
    return f"{worker_id}@{started!r}"


def verdict(holder: str | None, me: str, holder_alive: bool) -> Verdict:
    """What to do with a delivery whose attempt is claimed by `holder` (None: claimed by nobody)."""
    if holder is None:
        return "run"
    if holder == me or holder_alive:
        return "absorb"  # it runs (or ran) here or on a live worker: once is enough
    return "take_over"  # its holder died before it could finish: the attempt is ours to run


class Claims:
    def __init__(self, claims: KeyValue, workers: KeyValue, worker_id: str, started: float) -> None:
        self._claims = claims
        self._workers = workers
        self.me = holder_name(worker_id, started)

    async def claim(self, request: m.InferenceRequest) -> bool:
        """Whether this worker may run `request`'s attempt (True: it holds the claim now)."""
        key = subjects.claim_key(request.request_id, request.attempt)
        try:
            await self._claims.create(key, self.me.encode())
            return True
        except KeyWrongLastSequenceError:
            pass
        except Exception as error:  # no claim without the bus: run it rather than lose it
            log.warning("claim_failed", request_id=request.request_id, error=repr(error))
            return True
        try:
            entry = await self._claims.get(key)
        except KeyNotFoundError:
            return await self.claim(request)  # it aged out meanwhile
        except Exception as error:
            log.warning("claim_failed", request_id=request.request_id, error=repr(error))
            return True
        holder = (entry.value or b"").decode() or None
        decision = verdict(holder, self.me, await self._alive(holder))
        if decision == "absorb":
            return False
        if decision == "run":
            return True
        try:
            await self._claims.update(key, self.me.encode(), last=entry.revision)
        except KeyWrongLastSequenceError:
            return False  # another worker took it over first
        except Exception as error:  # its holder is gone: run it rather than lose it
            log.warning("claim_failed", request_id=request.request_id, error=repr(error))
        log.warning("claim_taken_over", request_id=request.request_id, attempt=request.attempt, holder=holder)
        return True

    async def _alive(self, holder: str | None) -> bool:
        """Whether `holder`'s process still heartbeats (the same worker id, started at the same time)."""
        if holder is None:
            return False
        worker_id, _, started = holder.rpartition("@")
        try:
            entry = await self._workers.get(subjects.worker_key(worker_id))
        except KeyNotFoundError:
            return False
        except Exception:
            return True  # cannot tell: a second run of a live holder's attempt is the worse mistake
        if not entry.value:
            return False  # a delete marker: its heartbeat expired
        try:
            beat = _beat_decoder.decode(entry.value)
        except msgspec.DecodeError:
            return True
        return holder_name(beat.worker_id, beat.started) == holder
