"""What this worker serves, checked against its release: on start and on every adapter load.

A worker started with `INFERBUS_WORKER_RELEASE` reads that release from the `models` bucket and
refuses to serve (exits with the differences) unless the files of its model directory hash to the
release's, its chat template is the release's, and the engine reports the flags the release pins.
An adapter whose local files do not hash to its registered version is refused at load the same
way. A worker without a release serves unpinned, and says so in its log and its heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.js import JetStreamContext
from prometheus_client import Gauge

from inferbus.releases import record, store
from inferbus.runtime import logs
from proto import messages as m

from . import engine_image

log = logs.get(__name__)

RELEASE_INFO = Gauge("inferbus_worker_release_info", "The release this worker verified it serves (1)",
                     ["model", "release"])


class ReleaseMismatch(SystemExit):
    """What the engine would serve is not what the release names: the worker does not start."""


async def verify_at_start(js: JetStreamContext, release_id: str, model: str, model_dir: str,
                          server_info: dict[str, Any],
                          image_check: Callable[[str], Awaitable[str | None]] | None = None) -> m.Release | None:
    """The verified release, or None when the worker runs unpinned; raises ReleaseMismatch.
    `image_check(release image)` says why the engine's image is not the release's (engine_image.py)."""
    if not release_id:
        log.warning("worker_unpinned", model=model,
                    consequence="no release verified: this worker is left out of canaries and pinned traffic")
        return None
    kv = await store.bucket(js)
    try:
        release = await store.resolve(kv, release_id)
    except LookupError as error:
        raise ReleaseMismatch(f"worker: INFERBUS_WORKER_RELEASE={release_id}: {error}") from None
    problems = await asyncio.to_thread(problems_of, release, model, model_dir, server_info)
    if image_check is not None:
        try:
            image_problem = await image_check(release.engine_image)
        except engine_image.ImageCheckError as error:
            image_problem = f"the engine image cannot be checked: {error}"
        if image_problem is not None:
            problems.append(image_problem)
    if problems:
        log.error("release_mismatch", release=release.id, problems=problems)
        raise ReleaseMismatch(
            f"worker: refusing to serve release {record.short(release.id)} of {release.model}: "
            + "; ".join(problems)
        )
    RELEASE_INFO.labels(model, release.id).set(1)
    log.info("release_verified", release=release.id, files=len(release.files), repo=release.repo,
             revision=release.revision, engine_image=release.engine_image)
    return release


def problems_of(release: m.Release, model: str, model_dir: str, server_info: dict[str, Any]) -> list[str]:
    """Every difference between the release and what this worker would serve (pure but for reading
    the model directory's files)."""
    problems = []
    if release.model != model:
        problems.append(f"the release is of model {release.model!r}, this worker serves {model!r}")
    if not model_dir:
        return [*problems, "INFERBUS_MODEL_DIR is not set: the engine's files cannot be checked"]
    problems += record.verify_files(release.files, model_dir)
    try:
        template = record.chat_template_sha256(model_dir)
    except record.InvalidRelease as error:
        problems.append(str(error))
    else:
        if template != release.chat_template_sha256:
            problems.append("the chat template differs from the release's")
    engine_dir = server_info.get("tokenizer_path") or server_info.get("model_dir")
    if engine_dir and Path(str(engine_dir)).resolve() != Path(model_dir).resolve():
        problems.append(f"the engine loaded {engine_dir}, not INFERBUS_MODEL_DIR {model_dir}")
    problems += record.verify_engine_flags(release.engine_flags, server_info)
    return problems


def adapter_problem(spec: m.AdapterSpec) -> str | None:
    """Why the adapter's files are not its registered version (None: they are, or they are not on
    this machine to hash: a hub id or remote path, which the engine resolves itself)."""
    directory = Path(spec.path)
    if not directory.is_dir():
        log.warning("adapter_unverified", adapter=spec.name, path=spec.path,
                    why="not a local directory: its files cannot be hashed here")
        return None
    try:
        digest = record.directory_digest(directory)
    except record.InvalidRelease as error:
        return str(error)
    if digest != spec.version:
        return f"its files at {spec.path} hash to {digest}, the registered version is {spec.version}"
    return None


def pin_refusal(request: m.InferenceRequest, release_id: str) -> str | None:
    """Why a worker serving `release_id` ("" unpinned) must not run `request`: the client pinned it
    to another release (an eval run). Placement sends a pinned request to its release only, but a
    dead worker's queue is moved to the shared queue, which every release's workers pull."""
    if not request.release_pinned or request.release == release_id:
        return None
    return f"pinned to release {request.release}, this worker serves {release_id or 'no release'}"


class ReleaseCounters:
    """Interactive requests finished by status, reported with load for the canary's SLO gate."""

    def __init__(self, release: m.Release | None) -> None:
        self.release_id = release.id if release is not None else ""
        self.ok = self.failed = self.cancelled = 0

    def count(self, status: str) -> None:
        if status == "completed":
            self.ok += 1
        elif status == "cancelled":
            self.cancelled += 1
        else:
            self.failed += 1

    def load_fields(self) -> dict[str, Any]:
        return {"release": self.release_id, "finished_ok": self.ok, "finished_failed": self.failed,
                "finished_cancelled": self.cancelled}


class AdapterOutcomes:
    """Per adapter version (engine name), the latencies and outcomes of interactive requests of
    adapters with a canary running, reported with load for the adapter canary's SLO gate. Kept
    for the worker's lifetime like the other counters, but only for `limit` versions (the least
    recently used goes first): only adapters under a canary are counted, and they are few."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self.by_version: dict[str, m.AdapterOutcomes] = {}

    def _of(self, engine_name: str) -> m.AdapterOutcomes:
        found = self.by_version.pop(engine_name, None)
        if found is None:
            found = m.AdapterOutcomes(ttft_hist=[0] * (len(m.LATENCY_BUCKETS_S) + 1),
                                      tpot_fine_hist=[0] * (len(m.TPOT_BUCKETS_S) + 1))
            while len(self.by_version) >= self.limit:
                del self.by_version[next(iter(self.by_version))]
        self.by_version[engine_name] = found  # last: the most recently used
        return found

    def first_token(self, engine_name: str, seconds: float) -> None:
        m.observe(self._of(engine_name).ttft_hist, m.LATENCY_BUCKETS_S, seconds)

    def finished(self, engine_name: str, status: str, tpot_s: float | None) -> None:
        outcomes = self._of(engine_name)
        if tpot_s is not None:
            m.observe(outcomes.tpot_fine_hist, m.TPOT_BUCKETS_S, tpot_s)
        if status == "completed":
            outcomes.finished_ok += 1
        elif status == "cancelled":
            outcomes.finished_cancelled += 1
        else:
            outcomes.finished_failed += 1

    def load_field(self) -> dict[str, m.AdapterOutcomes]:
        return {name: msgspec.structs.replace(o, ttft_hist=list(o.ttft_hist), tpot_fine_hist=list(o.tpot_fine_hist))
                for name, o in self.by_version.items()}
