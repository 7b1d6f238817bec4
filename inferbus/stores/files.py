"""The file store of the Files and Batch APIs: bytes on local disk, metadata in the `files` KV bucket.

Layout: `<root>/<tenant>/<file_id>`. A file is written to a temporary name beside its final place,
flushed to disk and renamed (atomic), and only then is its `FileRecord` put in KV: a record never
names bytes that are not there. Deleting removes the record first, then the bytes, for the same
reason. Gateways (uploads, downloads) and the batch service (reading inputs, writing outputs) share
one directory (`INFERBUS_FILES_DIR`: a shared volume when they run on several hosts).

A tenant sees only its own files: `get` of another tenant's id is None, exactly like a missing one.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import re
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable
from pathlib import Path
from typing import BinaryIO

import msgspec
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.runtime import logs
from inferbus.runtime.records import decode_or_none
from proto import messages as m
from proto import subjects

log = logs.get(__name__)

MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
_FLUSH_BYTES = 1024 * 1024  # buffer this much before each write to disk (done in a thread)
_TEMP_PREFIX = ".tmp-"
_decoder = msgspec.msgpack.Decoder(m.FileRecord)


class FileTooLarge(Exception):
    """An upload went over the store's limit (the API answers 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"The file is larger than the limit of {limit} bytes.")
        self.limit = limit


def sortable_hex(now: float | None = None) -> str:
    """32 hex digits: the time in milliseconds (12), then 80 random bits. Ids made of it sort in
    creation order, so lists ordered by (created_at, id) are in true creation order even within
    one second (OpenAI's timestamps are whole seconds)."""
    millis = int((time.time() if now is None else now) * 1000)
    return f"{millis:012x}{secrets.token_hex(10)}"


def new_file_id() -> str:
    return f"file-{sortable_hex()}"


def valid_file_id(file_id: str) -> bool:
    return FILE_ID.match(file_id) is not None


class Staging:
    """A file being written: bytes go to a temporary file beside the final one until `commit`.
    Use as `async with store.staging(tenant) as staged:`; leaving without commit removes it."""

    def __init__(self, store: FileStore, tenant: str, limit: int | None) -> None:
        self.store = store
        self.tenant = tenant
        self.limit = limit
        self.file_id = new_file_id()
        self.size = 0
        self._buffer = bytearray()
        directory = store.tenant_dir(tenant)
        _private_dir(store.root)
        _private_dir(directory)
        self.temp = directory / f"{_TEMP_PREFIX}{self.file_id}"
        # 0600 whatever the umask: tenants' prompts and outputs are for the service alone (the rename
        # into place keeps the mode).
        fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")

    async def write(self, data: bytes) -> None:
        """Append `data`; raises FileTooLarge as soon as the total passes the limit."""
        self.size += len(data)
        if self.limit is not None and self.size > self.limit:
            raise FileTooLarge(self.limit)
        self._buffer += data
        if len(self._buffer) >= _FLUSH_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        if self._buffer and self._file is not None:
            chunk, self._buffer = bytes(self._buffer), bytearray()
            await asyncio.to_thread(self._file.write, chunk)

    async def commit(self, filename: str, purpose: str, expires_at: int | None = None) -> m.FileRecord:
        """Make the file durable under its id, then record it in KV."""
        assert self._file is not None, "staged file already committed or discarded"
        await self._flush()
        file, self._file = self._file, None
        final = self.store.tenant_dir(self.tenant) / self.file_id
        try:
            await asyncio.to_thread(_seal, file, self.temp, final)
        except BaseException:
            self.temp.unlink(missing_ok=True)
            raise
        record = m.FileRecord(id=self.file_id, tenant=self.tenant, bytes=self.size, created_at=int(self.store.clock()),
                              filename=filename, purpose=purpose, expires_at=expires_at)
        key = subjects.file_key(self.tenant, self.file_id)
        try:
            await self.store.kv.create(key, m.encode(record))
        except Exception:
            # Remove the bytes only when the record is surely absent (a timed-out create may have
            # been stored): unrecorded bytes only waste disk, a record without bytes is a broken file.
            try:
                await self.store.kv.get(key)
            except KeyNotFoundError:
                final.unlink(missing_ok=True)
            except Exception:
                log.warning("file_commit_unknown", file_id=self.file_id, path=str(final))
            raise
        return record

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self.temp.unlink(missing_ok=True)

    async def __aenter__(self) -> Staging:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.discard()


def _seal(file: BinaryIO, temp: Path, final: Path) -> None:
    """fsync, rename into place and fsync the directory: after this the bytes survive a crash."""
    try:
        file.flush()
        os.fsync(file.fileno())
    finally:
        file.close()
    os.replace(temp, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _private_dir(path: Path) -> None:
    """Create `path` (and parents) and make it 0700: only the service may list or enter it."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != 0o700:
        os.chmod(path, 0o700)


class FileStore:
    def __init__(self, root: str | Path, kv: KeyValue, max_bytes: int = MAX_FILE_BYTES,
                 clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.kv = kv
        self.max_bytes = max_bytes
        self.clock = clock

    def tenant_dir(self, tenant: str) -> Path:
        return self.root / _tenant_token(tenant)

    def path(self, record: m.FileRecord) -> Path:
        return self.tenant_dir(record.tenant) / record.id

    def staging(self, tenant: str, limit: int | None = -1) -> Staging:
        """A new file of `tenant` to write into; `limit` -1 means the store's max_bytes, None none."""
        return Staging(self, tenant, self.max_bytes if limit == -1 else limit)

    async def create(self, tenant: str, filename: str, purpose: str,
                     source: AsyncIterable[bytes] | BinaryIO, expires_at: int | None = None) -> m.FileRecord:
        """Store an upload read from an async chunk iterator or a binary file object; raises
        FileTooLarge past `max_bytes` (nothing is kept then)."""
        async with self.staging(tenant) as staged:
            if isinstance(source, AsyncIterable):
                async for chunk in source:
                    await staged.write(chunk)
            else:
                while chunk := await asyncio.to_thread(source.read, _FLUSH_BYTES):
                    await staged.write(chunk)
            return await staged.commit(filename, purpose, expires_at)

    async def write(self, tenant: str, filename: str, purpose: str,
                    lines: Iterable[bytes] | AsyncIterable[bytes]) -> m.FileRecord:
        """Write a generated file (a batch's output or error file) line by line: each item is one
        line, a newline is added where it has none. No size limit applies."""
        async with self.staging(tenant, limit=None) as staged:
            if isinstance(lines, AsyncIterable):
                async for line in lines:
                    await staged.write(line if line.endswith(b"\n") else line + b"\n")
            else:
                for line in lines:
                    await staged.write(line if line.endswith(b"\n") else line + b"\n")
            return await staged.commit(filename, purpose)

    async def get(self, tenant: str, file_id: str) -> m.FileRecord | None:
        """The file `file_id` if it is `tenant`'s, else None (another tenant's file is invisible)."""
        if not valid_file_id(file_id):
            return None
        try:
            entry = await self.kv.get(subjects.file_key(tenant, file_id))
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        record = decode_or_none(_decoder, entry.value, store="files", key=entry.key)
        return record if record is not None and record.tenant == tenant and record.id == file_id else None

    async def all(self, tenant: str) -> builtins.list[m.FileRecord]:
        """Every file of `tenant`, in no particular order; one just uploaded included (`bus.kv_values`:
        a KV watch read to its first None can end before the values it should list)."""
        records = [decode_or_none(_decoder, entry.value, store="files", key=entry.key)
                   for entry in await bus.kv_values(self.kv, f"{_tenant_token(tenant)}.>")]
        return [record for record in records if record is not None and record.tenant == tenant]

    async def list(self, tenant: str, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
                   order: str = "desc") -> tuple[builtins.list[m.FileRecord], bool]:
        """One page of `tenant`'s files by creation time (`order` "desc" newest first, or "asc"),
        starting after the file `after`; returns (page, has_more)."""
        records = [r for r in await self.all(tenant) if purpose is None or r.purpose == purpose]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=order != "asc")
        return paginate(records, after, limit)

    async def delete(self, tenant: str, file_id: str) -> bool:
        """Delete `tenant`'s file; False if there is no such file of that tenant."""
        record = await self.get(tenant, file_id)
        if record is None:
            return False
        await self.kv.delete(subjects.file_key(tenant, file_id))
        await asyncio.to_thread(self.path(record).unlink, missing_ok=True)
        return True

    def open(self, record: m.FileRecord) -> BinaryIO:
        """The bytes of `record` for reading (FileNotFoundError if they are gone)."""
        return open(self.path(record), "rb")

    def iter_lines(self, record: m.FileRecord) -> Generator[tuple[int, bytes], None, None]:
        """(0-based line index, line without its line ending) for every line of the file, read
        as it goes (blocking: call from a thread, or use `aiter_lines`). A final newline does not
        make an extra empty line; empty lines elsewhere are yielded (the validator decides about them)."""
        with self.open(record) as file:
            for index, line in enumerate(file):
                yield index, line.rstrip(b"\r\n")

    async def aiter_lines(self, record: m.FileRecord, lines_per_read: int = 1000) -> AsyncIterator[tuple[int, bytes]]:
        """`iter_lines` without blocking the event loop: lines are read in a thread, a few at a time."""
        lines = self.iter_lines(record)

        def take() -> builtins.list[tuple[int, bytes]]:
            taken = []
            for item in lines:
                taken.append(item)
                if len(taken) >= lines_per_read:
                    break
            return taken

        try:
            while batch := await asyncio.to_thread(take):
                for item in batch:
                    yield item
        finally:
            lines.close()

    def sweep_temporary(self, older_than_s: float = 24 * 3600) -> int:
        """Remove temporary files left by writers that died mid-write; returns how many. Only old
        ones: another process may be writing a young one right now."""
        removed = 0
        cutoff = time.time() - older_than_s
        if not self.root.is_dir():
            return 0
        for temp in self.root.glob(f"*/{_TEMP_PREFIX}*"):
            try:
                if temp.stat().st_mtime < cutoff:
                    temp.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        if removed:
            log.info("files_temporary_swept", removed=removed)
        return removed


def _tenant_token(tenant: str) -> str:
    """The tenant's part of its keys (`<tenant>.<id>`), also its directory name: one safe token
    whatever the name (tenant ids are [a-z0-9-] anyway)."""
    return subjects.file_key(tenant, "x").rsplit(".", 1)[0]


def paginate(records: list, after: str | None, limit: int) -> tuple[list, bool]:
    """The `limit` records after the one whose id is `after` (from the start if None; an unknown
    `after` is an empty page), and whether more follow."""
    start = 0
    if after is not None:
        start = next((i + 1 for i, r in enumerate(records) if r.id == after), len(records))
    page = records[start:start + limit]
    return page, start + limit < len(records)
