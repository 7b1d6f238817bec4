"""A measured mix: a window of the usage ledger turned into the mix spec `sweep`, `plan` and `simulate` read.

Every finished request leaves one `UsageEvent` on the USAGE stream with the tokens the engine
reported: prompt, cached and completion. The mix keeps what the planner needs from them, the
joint distribution of input, output and cached tokens, by binning requests on a log2 grid of
(input, output) tokens: each non-empty cell becomes a class weighted by its request count, with
the cell's mean input and output tokens and its cached share of input tokens. Means are exact;
the spread within a cell (at most a factor of two per axis) is what the grid gives up.

Only completed requests count (a cancelled or failed one's output is cut short), and batch lines
only when asked: interactive capacity is planned from interactive traffic. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from proto import messages as m


@dataclass(frozen=True)
class UsageFilter:
    start: float  # unix seconds, inclusive (the request's finish time)
    end: float  # exclusive
    model: str | None = None
    tenant: str | None = None
    include_batch: bool = False


@dataclass
class _Cell:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class UsageMix:
    """What a window of usage holds, and what was left out of it."""

    counted: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason → requests
    cells: dict[tuple[int, int], _Cell] = field(default_factory=dict)
    first_finished: float = math.inf
    last_finished: float = -math.inf

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _bin(tokens: int) -> int:
    """log2 bin: 1 → 0, 2–3 → 1, 4–7 → 2, …"""
    return max(tokens, 1).bit_length() - 1


def collect(events: Iterable[m.UsageEvent], window: UsageFilter) -> UsageMix:
    result = UsageMix()
    seen: set[str] = set()
    for event in events:
        if not window.start <= event.finished < window.end:
            continue
        key = m.usage_msg_id(event)
        if key in seen:  # another report of the same request (the ledger keeps each reporter's)
            result.skip("duplicate")
            continue
        seen.add(key)
        if window.model is not None and event.model != window.model:
            continue
        if window.tenant is not None and event.tenant != window.tenant:
            continue
        if event.status != "completed":
            result.skip(event.status)
            continue
        if event.batch_id is not None and not window.include_batch:
            result.skip("batch")
            continue
        usage = event.usage
        if usage.prompt_tokens < 1 or usage.completion_tokens < 1:
            result.skip("no tokens")
            continue
        cell = result.cells.setdefault((_bin(usage.prompt_tokens), _bin(usage.completion_tokens)), _Cell())
        cell.requests += 1
        cell.input_tokens += usage.prompt_tokens
        cell.output_tokens += usage.completion_tokens
        cell.cached_tokens += min(usage.cached_tokens, usage.prompt_tokens - 1)
        result.counted += 1
        result.first_finished = min(result.first_finished, event.finished)
        result.last_finished = max(result.last_finished, event.finished)
    return result


def to_spec(usage: UsageMix, name: str) -> dict[str, Any]:
    """The mix spec (docs/capacity.md, "Workload mixes"): one fixed-length class per grid cell."""
    if usage.counted == 0:
        raise ValueError("no completed requests in the window: nothing to measure")
    classes = []
    for (input_bin, output_bin), cell in sorted(usage.cells.items()):
        classes.append(
            {
                "name": f"in {2**input_bin}-{2 ** (input_bin + 1) - 1} / "
                f"out {2**output_bin}-{2 ** (output_bin + 1) - 1}",
                "weight": cell.requests,
                "input_tokens": max(1, round(cell.input_tokens / cell.requests)),
                "output_tokens": max(1, round(cell.output_tokens / cell.requests)),
                "cached_fraction": round(cell.cached_tokens / cell.input_tokens, 4),
            }
        )
    return {"name": name, "classes": classes}
