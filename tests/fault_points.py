"""A worker stopped at a fault point (`INFERBUS_FAULT_HOLD`, `services/worker/fault_hold.py`) and
killed there, with a streamed chat completion from the openai SDK in flight."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

import openai

from inferbus.local.process import Process
from services.worker.fault_hold import marker_path

from .conftest import MODEL, Platform
from .waiting import wait_for


def stream_in_background(client: openai.OpenAI, content: str,
                         max_tokens: int) -> tuple[threading.Thread, dict[str, Any]]:
    """A streamed chat completion on a thread: its chunks land in `got["chunks"]`, its error in `got["error"]`."""
    got: dict[str, Any] = {}

    def stream() -> None:
        try:
            got["chunks"] = list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}))
        except Exception as error:
            got["error"] = error

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    return reader, got


def kill_the_held(platform: Platform, point: str) -> tuple[dict[str, Any], Process]:
    """Wait for a worker to stop at `point`, SIGKILL it: (what its marker says, the killed process)."""
    marker = marker_path(platform.stack.config.state_dir / "state", point)
    wait_for(marker.exists, timeout=30, what=f"a worker to stop at {point}")
    held = wait_for(lambda: json.loads(marker.read_text() or "null"), timeout=5, ignore=(ValueError,))
    victim = platform.stack.get(held["worker_id"])
    assert victim.pid == held["pid"]
    victim.signal(signal.SIGKILL)
    assert victim.wait(10)
    return held, victim


def whole_answer(reader: threading.Thread, got: dict[str, Any], held: dict[str, Any], tokens: int) -> Any:
    """The stream's chunks once it ended: the held request's, with no error and all `tokens` tokens."""
    reader.join(timeout=60)
    assert "error" not in got, got.get("error")
    chunks = got["chunks"]
    assert chunks[0].id == f"chatcmpl-{held['request_id']}"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens
    return chunks

