"""Stored Responses-API responses in the `responses` NATS KV bucket.

JetStream file storage, as the batch and file records: it survives restarts of the gateway and
of NATS (Redis here holds quota counters and runs without persistence), every gateway replica
sees the same records, and the bucket's max age is the retention period, enforced by the server.
Keys start with the tenant, so a tenant can only ever read its own responses.
"""

from __future__ import annotations

import re

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.runtime import logs
from inferbus.runtime.records import decode_or_none
from proto import messages as m
from proto import subjects

log = logs.get(__name__)
_decoder = m.decoder(m.StoredResponse)
# Ids this store hands out (`resp_<hex>`); anything else cannot name a stored response, and is not
# sent to NATS at all (a key is part of a subject, whose length the server limits).
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# Room for the record's envelope (ids, msgpack framing) on top of its two JSON documents.
_ENVELOPE_BYTES = 1024


class StoreUnavailable(Exception):
    """NATS did not answer a read or write of the bucket."""


class ResponseStore:
    def __init__(self, kv: KeyValue, max_bytes: int) -> None:
        self.kv = kv
        self.max_bytes = max_bytes
        self.drift: list[str] = []  # how the bucket differs from the settings (see `open`)

    @classmethod
    async def open(
        cls, js: JetStreamContext, retention_s: float, max_bytes: int, *, update: bool = False
    ) -> ResponseStore:
        """The bucket, created on first use. An existing bucket with another retention or size
        limit keeps it (only ops may reconfigure a bucket): the difference is logged and listed in
        `drift`; with `update` (an operator's identity) the bucket takes the configured ones."""
        name = subjects.RESPONSES_BUCKET
        try:
            kv = await js.key_value(name)
        except NotFoundError:
            try:
                kv = await js.create_key_value(KeyValueConfig(
                    bucket=name, history=1, ttl=retention_s, storage=StorageType.FILE,
                    max_value_size=max_bytes + _ENVELOPE_BYTES, replicas=bus.replicas()))
            except BadRequestError:  # created meanwhile by another gateway
                kv = await js.key_value(name)
        else:
            info = await js.stream_info(f"KV_{name}")
            config = info.config
            if (config.max_age != retention_s or config.max_msg_size != max_bytes + _ENVELOPE_BYTES) and not update:
                drift = [f"KV_{name}: max_age is {config.max_age}, wanted {retention_s}; max_msg_size is "
                         f"{config.max_msg_size}, wanted {max_bytes + _ENVELOPE_BYTES}"]
                log.error("stream_config_drift", stream=f"KV_{name}", drift=drift,
                          hint="INFERBUS_RESPONSES_RETENTION_S or INFERBUS_RESPONSES_MAX_BYTES changed: ops must "
                               "update the bucket (docs/security.md)")
                # What the bucket takes, not what the settings say: a larger record would be refused.
                limit = config.max_msg_size or 0
                store = cls(kv, min(max_bytes, limit - _ENVELOPE_BYTES) if limit > 0 else max_bytes)
                store.drift = drift
                bus.STREAM_DRIFT.labels(f"KV_{name}").set(1)
                return store
            if config.max_age != retention_s or config.max_msg_size != max_bytes + _ENVELOPE_BYTES:
                config.max_age = retention_s
                # The server refuses a duplicates window longer than the max age.
                config.duplicate_window = min(config.duplicate_window or retention_s, retention_s)
                config.max_msg_size = max_bytes + _ENVELOPE_BYTES
                await js.update_stream(config)
                log.info("responses_bucket_updated", retention_s=retention_s, max_bytes=max_bytes)
        bus.STREAM_DRIFT.labels(f"KV_{name}").set(0)
        return cls(kv, max_bytes)

    def fits(self, response: bytes, input_items: bytes) -> bool:
        return len(response) + len(input_items) <= self.max_bytes

    async def put(self, record: m.StoredResponse) -> None:
        try:
            await self.kv.put(subjects.response_key(record.tenant, record.id), m.encode(record))
        except (NatsError, TimeoutError) as error:
            raise StoreUnavailable(repr(error)) from error

    async def get(self, tenant: str, response_id: str) -> m.StoredResponse | None:
        if not _RESPONSE_ID.fullmatch(response_id):
            return None
        try:
            entry = await self.kv.get(subjects.response_key(tenant, response_id))
        except KeyNotFoundError:
            return None
        except (NatsError, TimeoutError) as error:
            raise StoreUnavailable(repr(error)) from error
        if entry.value is None:
            return None
        record = decode_or_none(_decoder, entry.value, store="responses", key=entry.key)
        return record if record is not None and record.tenant == tenant else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        if await self.get(tenant, response_id) is None:
            return False
        try:
            await self.kv.purge(subjects.response_key(tenant, response_id))
        except (NatsError, TimeoutError) as error:
            raise StoreUnavailable(repr(error)) from error
        return True
