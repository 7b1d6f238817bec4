"""Reading the platform's services' JSON logs in tests."""

from __future__ import annotations

import json
from pathlib import Path


def log_events(path: Path, event: str) -> list[dict]:
    """The records of `event` in a service's JSON log (lines that are not JSON are skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out
