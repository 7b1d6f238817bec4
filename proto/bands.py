"""Priority bands: the one home of the concept.

A band is how urgent a request is. Workers pull the bands' queues most important first, the
gateway sheds and orders by band, and the engine runs a request at its band's priority. Only the
interactive bands are a tenant's to choose; `batch` is the Batch API's lines, run in spare room.
"""

from __future__ import annotations

from typing import Literal, get_args

Band = Literal["premium", "standard", "batch"]
InteractiveBand = Literal["premium", "standard"]

BANDS: tuple[Band, ...] = get_args(Band)  # most important first
INTERACTIVE: tuple[InteractiveBand, ...] = get_args(InteractiveBand)  # most important first

# Priority inside an engine (SGLang's convention: larger runs first), so premium also wins within
# an engine. Batch sits below every interactive band by more than the engine's preemption
# threshold, so a waiting interactive request may evict a batch one.
ENGINE_PRIORITY: dict[Band, int] = {"premium": 10, "standard": 0, "batch": -100}


def through(band: str, among: tuple[Band, ...] = INTERACTIVE) -> tuple[Band, ...]:
    """`band` and every band of `among` more important than it: the work a new request of `band`
    waits behind. A band not in `among` is judged as the least important one."""
    if band not in among:
        return among
    return among[: among.index(band) + 1]  # type: ignore[arg-type]


def parse(text: str, setting: str) -> tuple[Band, ...]:
    """The bands a comma-separated setting names, in its order. A name that is no band is a
    configuration error: pulling from a subject nobody publishes would starve silently."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in BANDS]
    if unknown:
        raise ValueError(f"{setting}: {', '.join(map(repr, unknown))} is no band (the bands are {', '.join(BANDS)})")
    if len(set(names)) != len(names):
        raise ValueError(f"{setting}: a band is named twice in {text!r}")
    return names  # type: ignore[return-value]
