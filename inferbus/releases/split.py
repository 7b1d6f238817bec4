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


# ---- an adapter's canary: two versions of one adapter, within its requests -------------------

def adapter_sticky_key(rollout: m.Rollout, tenant: str, prompt_ids: list[int], block_size: int) -> str:
    """What keeps a client on one version: its conversation's first prefix block (`prefix`, the
    default for adapters: an adapter usually has one tenant, who would otherwise be all on one
    side), or its tenant. A prompt shorter than a block is its own key."""
    if rollout.sticky == "tenant":
        return f"tenant:{tenant}"
    first = prompt_ids[:block_size]
    return "prefix:" + hashlib.sha256(b"".join(i.to_bytes(4, "little", signed=False) for i in first)).hexdigest()[:16]


def adapter_in_canary(rollout: m.Rollout | None, spec: m.AdapterSpec) -> bool:
    """Whether requests of this adapter are split between two versions now."""
    return (rollout is not None and rollout.adapter == spec.name and rollout.state == "canary"
            and rollout.candidate is not None and rollout.candidate == spec.candidate_version)


def adapter_version(rollout: m.Rollout | None, spec: m.AdapterSpec, key: str) -> str:
    """The version of adapter `spec` that serves a request with sticky `key`.

    The rollout says which share goes to the candidate and, after a promotion, which version is
    stable; the registration says which versions have files to load. A rollout naming a version
    the registration no longer has (re-registered meanwhile) yields to the registration."""
    if rollout is None or rollout.adapter != spec.name:
        return spec.version
    known = {spec.version} | ({spec.candidate_version} if spec.candidate_version and spec.candidate_path else set())
    if adapter_in_canary(rollout, spec) and rollout.candidate in known and rollout.share > 0 and (
            rollout.share >= 1 or position(spec.name, key) < rollout.share):
        return rollout.candidate  # type: ignore[return-value]
    return rollout.stable if rollout.stable in known else spec.version


def match_adapter_pin(spec: m.AdapterSpec, pin: str) -> str | None:
    """The version of the adapter a client's pin (its digest, or 8+ hex of it) names, or None."""
    wanted = pin.strip().lower().removeprefix("sha256:")
    if len(wanted) < 8:
        return None
    for version in (spec.version, spec.candidate_version if spec.candidate_path else None):
        if version and version.removeprefix("sha256:").startswith(wanted):
            return version
    return None
