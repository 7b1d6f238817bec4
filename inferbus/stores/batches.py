"""The durable batch records: one `BatchRecord` per batch in the `batches` KV bucket, keyed
`batch_key(tenant, batch_id)`.

Gateways create records (validating) and move them to cancelling; the batch service makes every
other transition and keeps the counts current. Both write with compare-and-set on the KV revision
(`update`), so neither overwrites a change it has not seen: a cancel that races the batch
service's progress update is retried on the newer record, never lost.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import re
from collections.abc import AsyncIterator, Callable

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.runtime import logs
from inferbus.runtime.records import decode_or_none
from inferbus.stores.files import paginate, sortable_hex
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
_decoder = msgspec.msgpack.Decoder(m.BatchRecord)
# Compare-and-set retries: each conflict means another writer just succeeded, so a few suffice;
# more would mean a writer looping on the same key, which is a bug worth an exception.
_CAS_ATTEMPTS = 50


class UpdateConflict(Exception):
    """`update` lost the compare-and-set race `_CAS_ATTEMPTS` times in a row."""


def new_batch_id() -> str:
    return f"batch_{sortable_hex()}"  # in creation order, as lists show them


def valid_batch_id(batch_id: str) -> bool:
    return BATCH_ID.match(batch_id) is not None


class BatchStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def create(self, record: m.BatchRecord) -> int:
        """Store a new batch; returns its KV revision (fails if the key exists)."""
        return await self.kv.create(subjects.batch_key(record.tenant, record.id), m.encode(record))

    async def get(self, tenant: str, batch_id: str) -> m.BatchRecord | None:
        """The batch if it is `tenant`'s, else None (another tenant's batch is invisible)."""
        found = await self._get(tenant, batch_id)
        return found[0] if found is not None else None

    async def _get(self, tenant: str, batch_id: str) -> tuple[m.BatchRecord, int] | None:
        if not valid_batch_id(batch_id):
            return None
        try:
            entry = await self.kv.get(subjects.batch_key(tenant, batch_id))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        record = decode_or_none(_decoder, entry.value, store="batches", key=entry.key)
        if record is None or record.tenant != tenant or record.id != batch_id:
            return None
        return record, entry.revision  # type: ignore[return-value]

    async def update(self, tenant: str, batch_id: str,
                     change: Callable[[m.BatchRecord], m.BatchRecord | None]) -> m.BatchRecord | None:
        """Apply `change` to the current record with compare-and-set, re-reading and re-applying
        it after a conflicting write. `change` returns the new record, or None to leave the record
        as it is (then the current one is returned). None if there is no such batch."""
        for attempt in range(_CAS_ATTEMPTS):
            found = await self._get(tenant, batch_id)
            if found is None:
                return None
            record, revision = found
            changed = change(record)
            if changed is None:
                return record
            try:
                await self.kv.update(subjects.batch_key(tenant, batch_id), m.encode(changed), last=revision)
                return changed
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0.001 * attempt)  # another writer won: read its record and retry
        raise UpdateConflict(f"batch {batch_id}: {_CAS_ATTEMPTS} compare-and-set conflicts in a row")

    async def _scan(self, pattern: str) -> builtins.list[m.BatchRecord]:
        """The current records whose keys match `pattern` (`bus.kv_values`: a KV watch ends its
        initial values early when a record is rewritten while it scans, and the batch service
        rewrites records all the time)."""
        records = [decode_or_none(_decoder, entry.value, store="batches", key=entry.key)
                   for entry in await bus.kv_values(self.kv, pattern)]
        return [record for record in records if record is not None]  # an undecodable one is skipped

    async def list(self, tenant: str, after: str | None = None,
                   limit: int = 20) -> tuple[builtins.list[m.BatchRecord], bool]:
        """One page of `tenant`'s batches, newest first (created_at, then id), after the batch
        `after`; returns (page, has_more)."""
        prefix = subjects.batch_key(tenant, "x").rsplit(".", 1)[0]
        records = [r for r in await self._scan(f"{prefix}.>") if r.tenant == tenant]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return paginate(records, after, limit)

    async def active(self) -> builtins.list[m.BatchRecord]:
        """Every tenant's batches that are not finished (status not in BATCH_TERMINAL), oldest first."""
        records = [r for r in await self._scan(">") if r.status not in m.BATCH_TERMINAL]
        records.sort(key=lambda r: (r.created_at, r.id))
        return records

    async def watch(self, existing: bool = True) -> AsyncIterator[m.BatchRecord]:
        """Every batch record as it is written (deletions skipped), from when iteration begins,
        and first every current record if `existing`: `async for record in store.watch(): ...`.
        Leaving the loop (or cancelling it) stops the underlying KV watch."""
        # Without the existing records: skip every revision the bucket already had when we began.
        since = 0 if existing else (await self.kv.status()).stream_info.state.last_seq
        watcher = await self.kv.watchall(ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is None or not entry.value or entry.revision <= since:
                    continue  # None: the end of the records that existed when the watch began
                record = decode_or_none(_decoder, entry.value, store="batches", key=entry.key)
                if record is not None:
                    yield record
        finally:
            with contextlib.suppress(nats.errors.Error):  # the connection may be closed already
                await watcher.stop()
