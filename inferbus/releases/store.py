"""Releases and rollouts in the `models` NATS KV bucket.

`release.<64 hex>` holds an immutable `Release` (created once; a second create of the same content
is the same record), `rollout.<model>` a model's `Rollout`, updated with compare-and-set so that
an operator's command and the canary controller never overwrite each other. The bucket keeps a
history of each key, so every rollout state a model went through can be read back.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.runtime.records import decode_or_none
from inferbus.stores import adapters as registry
from proto import messages as m
from proto import subjects

HISTORY = 64  # the most NATS KV keeps per key

_release = msgspec.msgpack.Decoder(m.Release)
_rollout = msgspec.msgpack.Decoder(m.Rollout)


class Conflict(RuntimeError):
    """The rollout changed since it was read: read it again and decide again."""


async def bucket(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(subjects.MODELS_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(bucket=subjects.MODELS_BUCKET, storage=StorageType.FILE, history=HISTORY)
        )


async def put_release(kv: KeyValue, release: m.Release) -> bool:
    """Store `release` once; False when it was there already (same id: same content)."""
    try:
        await kv.create(subjects.release_key(release.id), m.encode(release))
    except KeyWrongLastSequenceError:
        return False
    return True


async def get_release(kv: KeyValue, release_id: str) -> m.Release | None:
    try:
        entry = await kv.get(subjects.release_key(release_id))
    except KeyNotFoundError:
        return None
    return decode_or_none(_release, entry.value, store="releases", key=entry.key) if entry.value else None


async def releases(kv: KeyValue) -> list[m.Release]:
    decoded = [decode_or_none(_release, entry.value, store="releases", key=entry.key)
               for entry in await bus.kv_values(kv, "release.>")]
    return sorted((r for r in decoded if r is not None), key=lambda r: r.created)


async def resolve(kv: KeyValue, reference: str) -> m.Release:
    """A release from its id or a unique prefix of its hex (as `inferbus release list` shows it)."""
    wanted = reference.removeprefix("sha256:").lower()
    if len(wanted) == 64:
        found = await get_release(kv, wanted)
        if found is None:
            raise LookupError(f"no release {reference}")
        return found
    matches = [r for r in await releases(kv) if r.id.removeprefix("sha256:").startswith(wanted)]
    if len(matches) != 1:
        raise LookupError(f"{'no' if not matches else 'more than one'} release starts with {reference!r}")
    return matches[0]


async def get_rollout(kv: KeyValue, model: str) -> tuple[m.Rollout | None, int]:
    """The model's rollout and its revision (0: none yet)."""
    try:
        entry = await kv.get(subjects.rollout_key(model))
    except KeyNotFoundError:
        return None, 0
    if not entry.value:
        return None, entry.revision or 0
    # An undecodable rollout reads as none; its revision stays, so a write replaces it.
    return decode_or_none(_rollout, entry.value, store="releases", key=entry.key), entry.revision or 0


def key_of(rollout: m.Rollout) -> str:
    if rollout.adapter:
        return subjects.adapter_rollout_key(rollout.model, rollout.adapter)
    return subjects.rollout_key(rollout.model)


async def get_adapter_rollout(kv: KeyValue, model: str, adapter: str) -> tuple[m.Rollout | None, int]:
    """An adapter's rollout and its revision (0: none yet)."""
    try:
        entry = await kv.get(subjects.adapter_rollout_key(model, adapter))
    except KeyNotFoundError:
        return None, 0
    if not entry.value:
        return None, entry.revision or 0
    # An undecodable rollout reads as none; its revision stays, so a write replaces it.
    return decode_or_none(_rollout, entry.value, store="releases", key=entry.key), entry.revision or 0


async def put_rollout(kv: KeyValue, rollout: m.Rollout, revision: int) -> int:
    """Write `rollout` if the key is still at `revision` (0: it must not exist); raises Conflict."""
    key = key_of(rollout)
    try:
        if revision == 0:
            return await kv.create(key, m.encode(rollout))
        return await kv.update(key, m.encode(rollout), last=revision)
    except KeyWrongLastSequenceError:
        raise Conflict(f"the rollout of {rollout.model} changed meanwhile") from None


async def rollout_history(kv: KeyValue, model: str, adapter: str | None = None) -> list[m.Rollout]:
    key = subjects.adapter_rollout_key(model, adapter) if adapter else subjects.rollout_key(model)
    try:
        entries = await kv.history(key)
    except (KeyNotFoundError, NoKeysError):
        return []
    decoded = [decode_or_none(_rollout, e.value, store="releases", key=e.key) for e in entries if e.value]
    return [rollout for rollout in decoded if rollout is not None]


def decode_rollout(value: bytes | None) -> m.Rollout | None:
    if not value:
        return None
    try:
        return _rollout.decode(value)
    except msgspec.DecodeError:
        return None


async def settle_adapter(js: JetStreamContext, rollout: m.Rollout) -> bool:
    """After an adapter's canary ended, make its registration say what serves: a promoted
    candidate becomes the registered version, a rolled-back one is dropped. Compare-and-set on the
    registration: an operator who registered another version meanwhile wins, and is left alone."""
    assert rollout.adapter is not None
    kv = await registry.bucket(js)
    for _ in range(5):
        spec, revision = await registry.get_with_revision(kv, rollout.adapter)
        if spec is None or spec.candidate_version is None:
            return True
        if rollout.state == "promoted" and spec.candidate_version == rollout.stable and spec.candidate_path:
            settled = msgspec.structs.replace(spec, version=spec.candidate_version, path=spec.candidate_path,
                                              candidate_version=None, candidate_path=None)
        elif rollout.state == "rolled_back" and spec.candidate_version == rollout.candidate:
            settled = msgspec.structs.replace(spec, candidate_version=None, candidate_path=None)
        else:
            return True  # the registration names another candidate now: not this canary's to settle
        try:
            await registry.update(kv, settled, revision)
            return True
        except registry.Conflict:
            continue
    return False
