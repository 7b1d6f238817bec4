"""What `inferbus up --autoscale` prints of its autoscaler: the decisions and the local actuator's
replica starts and stops, read from the autoscaler's JSON log as they are written (the replica
events exist only there: the local actuator's processes are its own)."""

from __future__ import annotations

import json
from pathlib import Path

import click


class DecisionTail:
    """The autoscaler's scale-ups, scale-downs and replica starts/stops, from its log, as they come;
    a disaggregated fleet's lines name their pool's role."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.warm: dict[str, int] = {}  # per pool, the warm-pool target last shown: a change is worth a line too

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for raw in data[:end].splitlines():
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            stamp = str(event.get("timestamp", ""))[11:19]
            pool = str(event.get("pool") or "")
            role = pool.rpartition(":")[2]
            who = "autoscaler" + (f" ({role})" if role in ("prefill", "decode") else "")
            if event.get("event") == "scale_decision":
                if event.get("direction") != "hold" or event.get("desired_warm", 0) != self.warm.get(pool, 0):
                    out.append(click.style(f" {stamp} {who}: {event.get('reason')}", fg="cyan"))
                self.warm[pool] = event.get("desired_warm", 0)
            elif event.get("event") in ("replica_started", "replica_stopping", "replica_exited"):
                what = event["event"].removeprefix("replica_")
                out.append(f" {stamp} {who}: {event.get('worker_id')} {what} (pid {event.get('worker_pid', '?')})")
        return out
