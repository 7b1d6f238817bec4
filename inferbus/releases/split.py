"""Which release serves a request while a model has a canary: a sticky hash split.

A request's side of the split is a hash of the model and its sticky key (the tenant, or the
conversation's first prefix block: the system prompt and the start of the first message), compared
with the candidate's share. The hash of a key never changes, so a tenant or conversation stays on
one side while the share stays put, and one that moved to the candidate stays there as the share
grows: prefix caches on both sides stay warm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar

from proto import messages as m


class _Worker(Protocol):
    release: str


W = TypeVar("W", bound=_Worker)


def position(model: str, key: str) -> float:
    """Where `key` falls in [0, 1) for `model` (uniform, stable across processes and restarts)."""
    digest = hashlib.sha256(f"{model}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def sticky_key(rollout: m.Rollout, tenant: str, block_hashes: list[int]) -> str:
    if rollout.sticky == "prefix" and block_hashes:
        return f"prefix:{block_hashes[0]}"
    return f"tenant:{tenant}"


def assign(rollout: m.Rollout | None, tenant: str, block_hashes: list[int]) -> str | None:
    """The release id that serves this request (None: the model has no rollout, any worker)."""
    if rollout is None:
        return None
    on_candidate = rollout.state == "canary" and rollout.candidate and rollout.share > 0 and (
        rollout.share >= 1 or position(rollout.model, sticky_key(rollout, tenant, block_hashes)) < rollout.share)
    if on_candidate:
        return rollout.candidate
    return rollout.stable


def match_pin(rollout: m.Rollout | None, pin: str) -> str | None:
    """The release a client's pin (an id or a prefix of its hex) names among those serving the model."""
    wanted = pin.strip().lower().removeprefix("sha256:")
    if rollout is None or len(wanted) < 8:
        return None
    for release in (rollout.stable, rollout.candidate):
        if release and release.removeprefix("sha256:").startswith(wanted):
            return release
    return None


def workers_of(found: Sequence[W], release: str, *, pinned: bool) -> list[W]:
    """The router's filter: workers of the release a request was assigned. When none is up, a
    split request goes to the others rather than fail; a pinned one is placed on none."""
    of_release = [worker for worker in found if worker.release == release]
    return of_release if of_release or pinned else list(found)
