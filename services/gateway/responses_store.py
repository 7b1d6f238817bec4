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

from inferbus import bus, logs
from inferbus.records import decode_or_none
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

    @classmethod
    async def open(cls, js: JetStreamContext, retention_s: float, max_bytes: int) -> ResponseStore:
        """The bucket, created on first use; an existing bucket takes the configured retention."""
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
            if config.max_age != retention_s or config.max_msg_size != max_bytes + _ENVELOPE_BYTES:
                config.max_age = retention_s
                # The server refuses a duplicates window longer than the max age.
                config.duplicate_window = min(config.duplicate_window or retention_s, retention_s)
                config.max_msg_size = max_bytes + _ENVELOPE_BYTES
                await js.update_stream(config)
                log.info("responses_bucket_updated", retention_s=retention_s, max_bytes=max_bytes)
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
