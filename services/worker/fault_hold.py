"""A fault point for tests: stop a worker at a named point of its work so a test can kill it there.

With `INFERBUS_FAULT_HOLD=<point>`, the first worker sharing `INFERBUS_STATE_DIR` to reach
`<point>` creates the file `fault-hold-<point>` there (its worker id, pid and request id as JSON)
and then waits forever: its heartbeat goes on, so nothing moves the request away until the test
kills the process. Every later arrival, on any worker, passes: only one request is held, so the
request's next attempt runs through. Creating the file is the test's condition to wait on.

Points: `after_ack` (the request's message is acked, its `Accepted` not yet sent: the gateway
still thinks it queued), `before_final` (the request's usage event is durable, its Final not yet sent).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from inferbus.runtime import logs

log = logs.get(__name__)
POINTS = ("after_ack", "before_final")


def marker_path(state_dir: str | Path, point: str) -> Path:
    return Path(state_dir) / f"fault-hold-{point}"


class FaultHold:
    def __init__(self, point: str, state_dir: str, worker_id: str) -> None:
        self.point = point
        self.state_dir = state_dir
        self.worker_id = worker_id

    async def at(self, point: str, request_id: str) -> None:
        """Hold here forever if this is the configured point and no process held at it before."""
        if point != self.point:
            return
        path = marker_path(self.state_dir, point)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return  # another arrival holds (or held) here
        with os.fdopen(fd, "w") as marker:
            json.dump({"worker_id": self.worker_id, "pid": os.getpid(), "request_id": request_id}, marker)
        log.warning("fault_hold", point=point, request_id=request_id)
        await asyncio.Event().wait()
