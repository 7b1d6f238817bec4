"""Prefill/decode disaggregation as SGLang 0.5.23 runs it: the pure parts.

A request is sent to a prefill and a decode engine at once with the same `bootstrap_room`. Each
side keeps a *room* per request and moves it through SGLang's `KVPoll` states:

- prefill: Bootstrapping (waiting for the decode side to say where the KV goes) → WaitingForInput
  (prefilling; chunks are sent as they are computed) → Transferring (last chunk on the link) →
  Success, or Failed (aborted, the decode side's abort, the bootstrap timeout);
- decode: Bootstrapping (handshake with the prefill's bootstrap server) → WaitingForInput
  (handshake done; waiting for KV room) → Transferring (KV reserved and the destination sent) →
  Success (the request starts decoding), or Failed (aborted, the prefill lost, the waiting
  timeout).

No I/O and no clock: times are passed in (wall seconds for SGLang's timeouts, the engine's
virtual seconds for the KV link). The HTTP/ZMQ shell is `disagg_server.py`. The messages and
timeouts are SGLang's (`sglang/srt/disaggregation/{prefill,decode}.py`, `common/conn.py`).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

from inferbus.timing import KvLink, ModelSpec

ABORTED = "Aborted by AbortReq."
# What SGLang's receiver of an ABORT records: nothing, so the exception says this.
FROM_ANOTHER_RANK = "Failed due to an unknown reason from another rank"
# SGLang's fake bootstrap host (its disaggregation/utils.py): a request naming it has no peer and
# its KV transfer is faked on either role (SGLang's warm-up and health checks send it). Its rooms
# use this as their peer's endpoint and bootstrap address.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
FAKE = "fake"
# Attempts and spacing of the decode side's fetch of the prefill's layout (SGLang's decode queue).
HANDSHAKE_ATTEMPTS = 15
HANDSHAKE_RETRY_S = 1.0
TRUE = ("true", "1", "yes", "y")  # what SGLang's EnvBool reads as true


class KVPoll(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass(frozen=True)
class Bootstrap:
    """The trio a client adds to `/generate` (SGLang's `bootstrap_host/port/room`)."""

    host: str | None
    port: int | None
    room: int

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Timeouts:
    """SGLang's disaggregation timeouts, from the same environment variables, with its floors."""

    bootstrap_s: float = 300.0  # prefill: no destination from the decode side within this
    waiting_s: float = 300.0  # decode: no KV within this after sending the destination
    heartbeat_interval_s: float = 5.0  # decode: how often it polls each prefill's /health
    heartbeat_max_failures: int = 2  # ... and after how many misses it gives the prefill up
    # decode: a failed transfer's KV is held until the prefill acknowledges the ABORT, or this long
    # (None: released at once, SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE off)
    deferred_release_s: float | None = 30.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Timeouts:
        env = os.environ if environ is None else environ
        return cls(
            bootstrap_s=float(env.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)),
            waiting_s=float(env.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)),
            heartbeat_interval_s=max(float(env.get("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0)), 2.0),
            heartbeat_max_failures=max(int(env.get("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)), 1),
            deferred_release_s=(
                float(env.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", 30.0))
                if env.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "true").lower() in TRUE else None
            ),
        )


def transfer_error(room: int, reason: str | None) -> str:
    return f"KVTransferError(bootstrap_room={room}): {reason or FROM_ANOTHER_RANK}"


def prefill_failure(stage: str, rid: str, room: int, reason: str | None) -> str:
    """SGLang's prefill-side message; `stage` is "bootstrap" (before the prefill ran) or "transfer"."""
    return f"Prefill {stage} failed for request rank=0 req.rid={rid!r} req.bootstrap_room={room} " \
           f"with exception {transfer_error(room, reason)}"


def decode_failure(stage: str, rid: str, room: int, reason: str | None) -> str:
    """SGLang's decode-side message; `stage` is "handshake" (before KV was reserved) or "transfer"."""
    return (f"Decode {stage} failed for request rank=0 decode_req.req.rid={rid!r} "
            f"decode_req.req.bootstrap_room={room} with exception {transfer_error(room, reason)}")


def missing_room(rid: str) -> str:
    return f"Invalid request: Disaggregated request received without bootstrap room id. req.rid={rid!r}"


def abort_reason(message: str, status_code: int) -> dict[str, object]:
    """A finish reason as SGLang's FINISH_ABORT renders it."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


# ---------------------------------------------------------------------------------- the KV link


@dataclass
class LinkQueue:
    """A prefill engine's link to its decode engines, in the engine's virtual time: sends go one
    after another (FIFO), each taking the link's time for its tokens."""

    link: KvLink
    tp: int  # the prefill engine's GPUs
    model: ModelSpec
    free_at: float = 0.0

    def send(self, tokens: int, ready_at: float, tp_decode: int) -> float:
        """Queue `tokens` tokens' KV, computed at `ready_at`, for a decode engine of `tp_decode`
        GPUs; when they have landed."""
        start = max(ready_at, self.free_at)
        self.free_at = start + self.link.transfer_s(tokens, self.tp, tp_decode, self.model)
        return self.free_at

    def bytes_of(self, tokens: int) -> float:
        return tokens * self.model.kv_bytes_per_token


# ---------------------------------------------------------------------------------- prefill side


@dataclass
class Destination:
    """Where the decode side wants a room's KV: its rank endpoint, and how many prompt tokens it
    already has in its own cache (SGLang's decode_prefix_len; those are not sent)."""

    endpoint: str
    prefix_len: int
    received_at: float  # wall seconds
    tp: int = 1  # the decode engine's GPUs (each receives its share of the KV)


@dataclass
class PrefillRoom:
    room: int
    rid: str
    opened_at: float  # wall seconds: the bootstrap timeout counts from here
    status: KVPoll = KVPoll.BOOTSTRAPPING
    failure: str | None = None
    destination: Destination | None = None
    sent_tokens: int = 0  # prompt tokens whose KV has been queued on the link
    first_sent_at: float | None = None  # virtual
    sent_bytes: float = 0.0
    landed_at: float | None = None  # virtual: when the last byte has landed

    @property
    def active(self) -> bool:
        return self.status not in (KVPoll.SUCCESS, KVPoll.FAILED)


class PrefillRooms:
    """The prefill role's rooms. The decode side's destination may arrive before the request
    itself (the client sends both at once), so destinations are kept by room until used or too
    old."""

    def __init__(self, timeouts: Timeouts, link: LinkQueue) -> None:
        self.timeouts = timeouts
        self.link = link
        self.rooms: dict[int, PrefillRoom] = {}
        self._destinations: dict[int, Destination] = {}
        self.last_transfer: tuple[float, float] | None = None  # (seconds, bytes) of the last finished transfer

    def open(self, room: int, rid: str, now: float) -> PrefillRoom:
        """A request arrived. Ready to prefill at once if its destination came first."""
        state = PrefillRoom(room, rid, now)
        if room in self.rooms and self.rooms[room].active:
            state.status, state.failure = KVPoll.FAILED, "Duplicate bootstrap room"
            return state
        self.rooms[room] = state
        destination = self._destinations.pop(room, None)
        if destination is not None:
            self._bootstrapped(state, destination)
        return state

    def destination(self, room: int, endpoint: str, prefix_len: int, now: float, tp: int = 1) -> PrefillRoom | None:
        """The decode side reserved KV and says where it goes; the room, if that starts its prefill."""
        destination = Destination(endpoint, max(0, prefix_len), now, tp)
        state = self.rooms.get(room)
        if state is None or not state.active:
            self._destinations[room] = destination
            return None
        if state.status != KVPoll.BOOTSTRAPPING:
            return None
        self._bootstrapped(state, destination)
        return state

    @staticmethod
    def _bootstrapped(state: PrefillRoom, destination: Destination) -> None:
        state.destination = destination
        state.status = KVPoll.WAITING_FOR_INPUT

    def fail(self, room: int, reason: str | None) -> PrefillRoom | None:
        """Abort (`reason` ABORTED) or the decode side's ABORT (`reason` None: SGLang records
        nothing for it); the room if it was still active."""
        state = self.rooms.get(room)
        if state is None or not state.active:
            return None
        state.status, state.failure = KVPoll.FAILED, reason
        return state

    def expired(self, now: float) -> list[PrefillRoom]:
        """Rooms whose decode side never said where to send the KV: failed by SGLang's bootstrap timeout."""
        failed = []
        for state in self.rooms.values():
            elapsed = now - state.opened_at
            if state.status == KVPoll.BOOTSTRAPPING and elapsed >= self.timeouts.bootstrap_s:
                state.status = KVPoll.FAILED
                state.failure = f"Request {state.room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping"
                failed.append(state)
        for room in [r for r, d in self._destinations.items() if now - d.received_at >= self.timeouts.bootstrap_s]:
            del self._destinations[room]
        return failed

    def computed(self, room: int, tokens: int, now: float) -> None:
        """The first `tokens` prompt tokens have KV (cached or prefilled) at virtual time `now`:
        queue the ones not sent yet (SGLang sends every chunk as it is computed, the cached prefix
        first, and nothing the decode side already holds)."""
        state = self.rooms.get(room)
        if state is None or state.status != KVPoll.WAITING_FOR_INPUT or state.destination is None:
            return
        start = max(state.sent_tokens, state.destination.prefix_len)
        if tokens <= start:
            return
        self._send(state, tokens - start, now)
        state.sent_tokens = tokens

    def finish(self, room: int, prompt_tokens: int, now: float) -> float | None:
        """The prefill is done (its first token sampled): send the rest; when it has all landed."""
        state = self.rooms.get(room)
        if state is None or state.status != KVPoll.WAITING_FOR_INPUT:
            return None
        self.computed(room, prompt_tokens, now)
        if state.first_sent_at is None:  # nothing to send (the decode side had it all): a notice
            self._send(state, 0, now)
        state.status = KVPoll.TRANSFERRING
        assert state.destination is not None
        state.landed_at = now if state.destination.endpoint == FAKE else self.link.free_at
        return state.landed_at

    def _send(self, state: PrefillRoom, tokens: int, now: float) -> None:
        if state.first_sent_at is None:
            state.first_sent_at = now
        assert state.destination is not None
        if state.destination.endpoint == FAKE:
            return  # SGLang's FakeKVSender: nothing moves, done at once
        self.link.send(tokens, now, state.destination.tp)
        state.sent_bytes += self.link.bytes_of(tokens)

    def succeed(self, room: int) -> PrefillRoom | None:
        state = self.rooms.pop(room, None)
        if state is None or state.status != KVPoll.TRANSFERRING:
            return None
        state.status = KVPoll.SUCCESS
        fake = state.destination is not None and state.destination.endpoint == FAKE
        if state.first_sent_at is not None and state.landed_at is not None and not fake:
            self.last_transfer = (state.landed_at - state.first_sent_at, state.sent_bytes)
        return state

    def close(self, room: int) -> None:
        self.rooms.pop(room, None)

    def count(self, *statuses: KVPoll) -> int:
        return sum(state.status in statuses for state in self.rooms.values())


# ---------------------------------------------------------------------------------- decode side


@dataclass
class DecodeRoom:
    room: int
    rid: str
    addr: str  # the prefill's bootstrap server, host:port
    prompt_tokens: int
    opened_at: float  # wall
    status: KVPoll = KVPoll.BOOTSTRAPPING
    failure: str | None = None
    endpoint: str | None = None  # the prefill rank's endpoint, once the handshake is done
    reserved_tokens: int = 0  # KV held for the transfer
    matched_blocks: int = 0  # blocks of this engine's own cache the prompt starts with
    sent_at: float | None = None  # wall: when the destination went to the prefill

    @property
    def active(self) -> bool:
        return self.status not in (KVPoll.SUCCESS, KVPoll.FAILED)

    @property
    def stage(self) -> str:
        """Which of SGLang's messages a failure takes: before the destination was sent, the
        request is in the decode engine's prealloc queue ("handshake"), after it in its transfer
        queue ("transfer")."""
        return "transfer" if self.sent_at is not None else "handshake"


@dataclass(frozen=True)
class Held:
    """The KV a failed transfer had reserved, which SGLang's decode engine keeps (its deferred
    release) until the prefill acknowledges the ABORT, since until then the prefill may still be
    writing into it, or until `deadline` (wall) when no acknowledgement comes (a dead prefill)."""

    room: int
    tokens: int  # allocated for the transfer
    hashes: tuple[int, ...]  # the blocks of this engine's cache the prompt matched, still locked
    deadline: float


class DecodeRooms:
    """The decode role's rooms, its handshakes with prefill bootstrap servers and their heartbeats,
    and the KV of failed transfers held for their prefill's acknowledgement."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self.rooms: dict[int, DecodeRoom] = {}
        self.held: dict[int, Held] = {}
        self.endpoints: dict[str, str] = {}  # bootstrap addr → the prefill rank's endpoint (SGLang's connection pool)
        self._handshake_failures: dict[str, int] = {}
        self._heartbeat_misses: dict[str, int] = {}

    def open(self, room: int, rid: str, addr: str, prompt_tokens: int, now: float) -> DecodeRoom:
        state = DecodeRoom(room, rid, addr, prompt_tokens, now)
        if room in self.rooms and self.rooms[room].active:
            state.status, state.failure = KVPoll.FAILED, "Duplicate decode bootstrap room"
            return state
        self.rooms[room] = state
        endpoint = self.endpoints.get(addr)
        if endpoint is not None:
            state.endpoint, state.status = endpoint, KVPoll.WAITING_FOR_INPUT
        return state

    def waiting_for_handshake(self) -> dict[str, list[DecodeRoom]]:
        pending: dict[str, list[DecodeRoom]] = {}
        for state in self.rooms.values():
            if state.status == KVPoll.BOOTSTRAPPING:
                pending.setdefault(state.addr, []).append(state)
        return pending

    def handshake(self, addr: str, endpoint: str | None) -> list[DecodeRoom]:
        """The result of one attempt to learn the prefill's rank endpoint from its bootstrap server
        (None: it failed). Success moves that prefill's rooms on; the 15th failure in a row fails
        them, as SGLang's decode queue does. Returns the rooms that changed."""
        waiting = [s for s in self.rooms.values() if s.status == KVPoll.BOOTSTRAPPING and s.addr == addr]
        if endpoint is not None:
            self.endpoints[addr] = endpoint
            self._handshake_failures.pop(addr, None)
            for state in waiting:
                state.endpoint, state.status = endpoint, KVPoll.WAITING_FOR_INPUT
            return waiting
        failures = self._handshake_failures.get(addr, 0) + 1
        if failures < HANDSHAKE_ATTEMPTS:
            self._handshake_failures[addr] = failures
            return []
        self._handshake_failures.pop(addr, None)
        for state in waiting:  # SGLang aborts their receivers
            state.status, state.failure = KVPoll.FAILED, ABORTED
        return waiting

    def preallocation_queue(self) -> list[DecodeRoom]:
        """Handshaken rooms waiting for KV room, oldest first."""
        return sorted((s for s in self.rooms.values() if s.status == KVPoll.WAITING_FOR_INPUT),
                      key=lambda s: s.opened_at)

    def sent(self, room: int, reserved_tokens: int, matched_blocks: int, now: float) -> None:
        state = self.rooms[room]
        state.reserved_tokens, state.matched_blocks = reserved_tokens, matched_blocks
        state.status, state.sent_at = KVPoll.TRANSFERRING, now

    def landed(self, room: int) -> DecodeRoom | None:
        """The prefill says the KV has landed: the room's request can decode."""
        state = self.rooms.pop(room, None)
        if state is None or state.status != KVPoll.TRANSFERRING:
            if state is not None:
                self.rooms[room] = state
            return None
        state.status = KVPoll.SUCCESS
        return state

    def fail(self, room: int, reason: str | None) -> DecodeRoom | None:
        state = self.rooms.get(room)
        if state is None or not state.active:
            return None
        state.status, state.failure = KVPoll.FAILED, reason
        return state

    def heartbeat(self, addr: str, ok: bool) -> list[DecodeRoom]:
        """One poll of a prefill's /health. After `heartbeat_max_failures` misses in a row the
        prefill is given up: its endpoint forgotten and every room of it not yet landed failed."""
        if ok:
            self._heartbeat_misses[addr] = 0
            return []
        misses = self._heartbeat_misses.get(addr, 0) + 1
        self._heartbeat_misses[addr] = misses
        if misses < self.timeouts.heartbeat_max_failures:
            return []
        self._heartbeat_misses.pop(addr, None)
        self.endpoints.pop(addr, None)
        reason = f"Lost connection with prefill instance (bootstrap_addr: {addr})"
        failed = [s for s in self.rooms.values() if s.addr == addr and s.active]
        for state in failed:
            state.status, state.failure = KVPoll.FAILED, reason
        return failed

    def watched(self) -> list[str]:
        """Prefill bootstrap servers to heartbeat: those this engine has handshaken with."""
        return [addr for addr in self.endpoints if addr != FAKE]

    def expired(self, now: float) -> list[DecodeRoom]:
        """Rooms whose KV has not landed `waiting_s` after the destination was sent."""
        failed = []
        for state in self.rooms.values():
            if state.status == KVPoll.TRANSFERRING and state.sent_at is not None:
                elapsed = now - state.sent_at
                if elapsed >= self.timeouts.waiting_s:
                    state.status = KVPoll.FAILED
                    state.failure = f"Request {state.room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
                    failed.append(state)
        return failed

    def close(self, room: int) -> None:
        self.rooms.pop(room, None)

    def hold(self, state: DecodeRoom, hashes: tuple[int, ...], now: float) -> bool:
        """Whether a failed room's reservation is held rather than freed (SGLang's deferred decode
        KV release): only when its destination went to a real prefill, which may be writing into
        it, and the release is deferred at all. The caller sends the ABORT either way."""
        if self.timeouts.deferred_release_s is None or state.sent_at is None or state.endpoint in (None, FAKE):
            return False
        self.held[state.room] = Held(state.room, state.reserved_tokens, hashes, now + self.timeouts.deferred_release_s)
        return True

    def acknowledged(self, room: int) -> Held | None:
        """The prefill acknowledged the room's ABORT: its held KV, to free now."""
        return self.held.pop(room, None)

    def overdue(self, now: float) -> list[Held]:
        """Held KV whose acknowledgement did not come in time: freed anyway, as SGLang does."""
        due = [held for held in self.held.values() if now >= held.deadline]
        for held in due:
            del self.held[held.room]
        return due

    def count(self, *statuses: KVPoll) -> int:
        return sum(state.status in statuses for state in self.rooms.values())

    @property
    def reserved_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self.rooms.values() if s.status == KVPoll.TRANSFERRING)


def preallocation_fits(available: int, prompt_tokens: int, matched_tokens: int, active_requests: int,
                       reserved_per_request: int) -> bool:
    """Whether the decode engine can reserve KV for a transfer (SGLang's prealloc admission): the
    uncached prompt plus `num_reserved_decode_tokens` for it must fit in what is free after that
    reservation for every request already running or in transfer."""
    allocatable = available - reserved_per_request * active_requests
    return allocatable >= prompt_tokens - matched_tokens + reserved_per_request

