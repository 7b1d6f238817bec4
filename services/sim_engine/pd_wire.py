"""The messages between a prefill and a decode engine of the simulator: multipart ZMQ frames,
ASCII, the simulator's own format since no KV moves (`disagg_server.py` sends and receives them).

- `DEST room endpoint prefix_len tp`: decode → prefill, where the room's KV goes;
- `ABORT room endpoint`: decode → prefill, the decode side gave the room up;
- `DONE room json`: prefill → decode, the KV has landed (the first token, the cached tokens);
- `ACK room`: prefill → decode, the room's ABORT is taken: nothing more will be written into the
  KV the decode side reserved for it (SGLang's `ABORT_ACK`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DestMessage:
    room: int
    endpoint: str
    prefix_len: int
    tp: int


@dataclass(frozen=True)
class AbortMessage:
    room: int
    endpoint: str  # the decode rank's, where the acknowledgement goes


@dataclass(frozen=True)
class AckMessage:
    room: int


@dataclass(frozen=True)
class DoneMessage:
    room: int
    payload: Any  # the prefill's JSON as sent; its fields are read where it is used


PdMessage = DestMessage | AbortMessage | DoneMessage | AckMessage


def dest_frames(room: int, endpoint: str, prefix_len: int, tp: int) -> list[bytes]:
    return [b"DEST", str(room).encode(), endpoint.encode(), str(prefix_len).encode(), str(tp).encode()]


def abort_frames(room: int, endpoint: str) -> list[bytes]:
    return [b"ABORT", str(room).encode(), endpoint.encode()]


def ack_frames(room: int) -> list[bytes]:
    return [b"ACK", str(room).encode()]


def done_frames(room: int, payload: dict[str, Any]) -> list[bytes]:
    return [b"DONE", str(room).encode(), json.dumps(payload).encode()]


def parse(frames: list[bytes], mode: str) -> PdMessage | None:
    """The message an engine of `mode` takes from `frames`; None for a kind it does not take.
    IndexError or ValueError if the frames are malformed."""
    kind, room = frames[0], int(frames[1])
    if kind == b"DEST" and mode == "prefill":
        return DestMessage(room, frames[2].decode(), int(frames[3]), int(frames[4]))
    if kind == b"ABORT" and mode == "prefill":
        return AbortMessage(room, frames[2].decode())
    if kind == b"DONE" and mode == "decode":
        return DoneMessage(room, json.loads(frames[2]))
    if kind == b"ACK" and mode == "decode":
        return AckMessage(room)
    return None
