"""The LoRA adapter registry: `AdapterSpec`s in the `adapters` NATS KV bucket.

Admins register an adapter with a pinned version (a digest). Gateways list and resolve them for
tenants (`model: "<adapter name>"`), workers look up the path to load, the router learns from
heartbeats where each is loaded.
"""

from __future__ import annotations

import base64
import re
import time

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, InvalidKeyError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from proto import messages as m
from proto import subjects

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_decoder = msgspec.msgpack.Decoder(m.AdapterSpec)


class InvalidAdapter(ValueError):
    pass


def new_spec(name: str, base_model: str, version: str, path: str, owner: str | None = None) -> m.AdapterSpec:
    """Validate and build a registration; raises InvalidAdapter with a message meant for people."""
    if not NAME.match(name) or ":" in name or "@" in name:
        raise InvalidAdapter(f"adapter name {name!r} must be 1-128 letters, digits, '.', '_', '-' or '/'")
    if not DIGEST.match(version):
        raise InvalidAdapter(
            f"adapter version {version!r} is not a pinned digest: give 'sha256:<64 hex digits>' "
            "(moving tags such as 'latest' are refused, so every worker loads the same weights)"
        )
    if not path:
        raise InvalidAdapter("adapter path must not be empty")
    return m.AdapterSpec(name=name, base_model=base_model, version=version, path=path, created=time.time(), owner=owner)


async def bucket(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(subjects.ADAPTERS_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=subjects.ADAPTERS_BUCKET, storage=StorageType.FILE, history=5, replicas=bus.replicas()
            )
        )


def key(name: str) -> str:
    # KV keys allow only [-/_=.a-zA-Z0-9]: base64url keeps any adapter name one safe key.
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


async def put(kv: KeyValue, spec: m.AdapterSpec) -> None:
    await kv.put(key(spec.name), m.encode(spec))


class Conflict(RuntimeError):
    """The registration changed since it was read."""


async def get_with_revision(kv: KeyValue, name: str) -> tuple[m.AdapterSpec | None, int]:
    """The registration and its revision (0: none)."""
    try:
        entry = await kv.get(key(name))
    except (KeyNotFoundError, InvalidKeyError):
        return None, 0
    return decode(entry.value), entry.revision or 0


async def update(kv: KeyValue, spec: m.AdapterSpec, revision: int) -> None:
    """Write `spec` if its key is still at `revision` (0: it must not exist); raises Conflict."""
    try:
        if revision == 0:
            await kv.create(key(spec.name), m.encode(spec))
        else:
            await kv.update(key(spec.name), m.encode(spec), last=revision)
    except KeyWrongLastSequenceError:
        raise Conflict(f"the registration of adapter {spec.name} changed meanwhile") from None


async def get(kv: KeyValue, name: str) -> m.AdapterSpec | None:
    try:
        entry = await kv.get(key(name))
    except (KeyNotFoundError, InvalidKeyError):  # an empty name makes no valid key: no such adapter
        return None
    return decode(entry.value)


async def delete(kv: KeyValue, name: str) -> bool:
    if await get(kv, name) is None:
        return False
    await kv.delete(key(name))
    return True


async def list_all(kv: KeyValue) -> list[m.AdapterSpec]:
    specs = [decode(entry.value) for entry in await bus.kv_values(kv)]
    return sorted((spec for spec in specs if spec is not None), key=lambda spec: spec.name)


def decode(value: bytes | None) -> m.AdapterSpec | None:
    if not value:
        return None
    try:
        return _decoder.decode(value)
    except msgspec.DecodeError:
        return None
