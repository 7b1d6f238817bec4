"""The messages between a simulated prefill and decode engine (services/sim_engine/pd_wire.py):
each role takes only its own kinds, and malformed frames raise for the shell to log."""

from __future__ import annotations

import json

import pytest

from services.sim_engine import pd_wire


def test_each_message_reads_back_as_it_was_sent_on_the_role_that_takes_it():
    assert pd_wire.dest_frames(7, "tcp://d:1", 128, 2) == [b"DEST", b"7", b"tcp://d:1", b"128", b"2"]
    assert pd_wire.parse(pd_wire.dest_frames(7, "tcp://d:1", 128, 2), "prefill") == pd_wire.DestMessage(
        7, "tcp://d:1", 128, 2)
    assert pd_wire.parse(pd_wire.abort_frames(-3, "tcp://d:1"), "prefill") == pd_wire.AbortMessage(-3, "tcp://d:1")
    assert pd_wire.parse(pd_wire.ack_frames(-3), "decode") == pd_wire.AckMessage(-3)
    payload = {"output_id": 5, "text": "a", "cached_tokens": 0, "prompt_tokens": 9}
    frames = pd_wire.done_frames(7, payload)
    assert frames[:2] == [b"DONE", b"7"] and json.loads(frames[2]) == payload
    assert pd_wire.parse(frames, "decode") == pd_wire.DoneMessage(7, payload)


def test_a_role_does_not_take_the_other_roles_messages():
    assert pd_wire.parse(pd_wire.dest_frames(7, "tcp://d:1", 0, 1), "decode") is None
    assert pd_wire.parse(pd_wire.abort_frames(7, "tcp://d:1"), "decode") is None
    assert pd_wire.parse(pd_wire.done_frames(7, {}), "prefill") is None
    assert pd_wire.parse(pd_wire.ack_frames(7), "prefill") is None
    assert pd_wire.parse([b"HELLO", b"7"], "prefill") is None
    # Not read on the wrong role, so not malformed there either.
    assert pd_wire.parse([b"DONE", b"7", b"not json"], "prefill") is None


@pytest.mark.parametrize("frames, mode, error", [
    ([b"DEST"], "prefill", IndexError),
    ([b"DEST", b"seven", b"tcp://d:1", b"0", b"1"], "prefill", ValueError),
    ([b"DEST", b"7", b"tcp://d:1"], "prefill", IndexError),
    ([b"ABORT", b"7"], "prefill", IndexError),
    ([b"ACK", b"seven"], "decode", ValueError),
    ([b"DONE", b"7", b"not json"], "decode", ValueError),
])
def test_malformed_frames_raise(frames: list[bytes], mode: str, error: type[Exception]):
    with pytest.raises(error):
        pd_wire.parse(frames, mode)
