"""A durable local outbox for JetStream publishes that must never be lost (usage events).

`add` returns once the message is on disk (SQLite, `synchronous=FULL`: fsynced at commit); a
background task then publishes it with its `Nats-Msg-Id` and deletes it only after JetStream
acknowledged it, retrying with backoff for as long as NATS is away. After a crash or restart,
`start` republishes whatever is still pending. The message id makes every retry safe: JetStream
drops a duplicate inside the stream's duplicate window, and the billing ledger counts one event
per id after that.

The publish starts at once, alongside the disk write (so a message reaches JetStream as soon as
without the outbox); it is deleted only once both are done. Writes made while a commit is on disk
are committed together (group commit), off the event loop. The deletes of acknowledged messages
ride in the next write's transaction (one commit, one fsync, per message instead of two when
messages come one at a time), or are committed by themselves `delete_delay_s` later when no write
comes: a delete lost in a crash only republishes a duplicate, which the message id drops.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from inferbus.runtime import logs

log = logs.get(__name__)

Publish = Callable[[str, bytes, str], Awaitable[object]]  # (subject, data, msg_id), raises on failure

_SCHEMA = """CREATE TABLE IF NOT EXISTS pending (
    msg_id TEXT PRIMARY KEY, subject TEXT NOT NULL, data BLOB NOT NULL, added REAL NOT NULL)"""


class Outbox:
    def __init__(self, path: Path, publish: Publish, *, retry_min_s: float = 0.2, retry_max_s: float = 5.0,
                 delete_delay_s: float = 0.25) -> None:
        self.path = path
        self._publish = publish
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._delete_delay_s = delete_delay_s
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # one statement or transaction at a time on the connection
        self._to_write: list[tuple[str, str, bytes, asyncio.Future[None]]] = []
        self._writing = False
        self._to_delete: list[str] = []
        self._deleting = False
        self._ready: asyncio.Queue[tuple[str, str, bytes]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._in_flight: set[str] = set()
        self._deliveries: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    async def start(self) -> None:
        """Open (or create) the outbox and queue what a previous run left unpublished."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._db = await asyncio.to_thread(self._open)
        rows = await asyncio.to_thread(self._pending_rows)
        if rows:
            log.info("outbox_republishing", path=str(self.path), pending=len(rows))
        for msg_id, subject, data in rows:
            self._ready.put_nowait((msg_id, subject, data))
        self._task = asyncio.create_task(self._run(), name="outbox")

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # WAL + FULL: every commit is fsynced
        db.execute(_SCHEMA)
        self.path.chmod(0o600)
        return db

    def _pending_rows(self) -> list[tuple[str, str, bytes]]:
        assert self._db is not None
        with self._lock:
            return list(self._db.execute("SELECT msg_id, subject, data FROM pending ORDER BY added"))

    def pending(self) -> int:
        """Messages on disk and not yet acknowledged (a blocking read; for tests and shutdown)."""
        assert self._db is not None
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM pending").fetchone()[0])

    async def add(self, subject: str, data: bytes, msg_id: str) -> None:
        """Store the message durably (returns once it is on disk); it is published, and retried
        until acknowledged, in the background."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._to_write.append((msg_id, subject, data, future))
        if not self._writing:
            self._writing = True
            asyncio.ensure_future(self._write())
        self._start_delivery(msg_id, subject, data, written=future)
        await future

    async def _write(self) -> None:
        try:
            while self._to_write:
                batch, self._to_write = self._to_write, []
                deletes, self._to_delete = self._to_delete, []  # acknowledged: they ride in this commit
                try:
                    await asyncio.to_thread(self._insert, [(i, s, d) for i, s, d, _ in batch], deletes)
                except BaseException as error:
                    self._to_delete.extend(deletes)
                    for *_, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    if not isinstance(error, Exception):
                        raise
                    continue
                for *_, future in batch:
                    if not future.done():
                        future.set_result(None)
        finally:
            self._writing = False

    def _insert(self, rows: list[tuple[str, str, bytes]], deletes: Sequence[str] = ()) -> None:
        assert self._db is not None
        now = time.time()
        with self._lock, self._db:  # one transaction, one fsync
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR IGNORE INTO pending VALUES (?, ?, ?, ?)",
                                 [(i, s, d, now) for i, s, d in rows])
            if deletes:
                self._db.executemany("DELETE FROM pending WHERE msg_id = ?", [(i,) for i in deletes])

    def _delete(self, msg_ids: list[str]) -> None:
        assert self._db is not None
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM pending WHERE msg_id = ?", [(i,) for i in msg_ids])

    async def _delete_acknowledged(self) -> None:
        try:
            await asyncio.sleep(self._delete_delay_s)  # the next write's commit may take them along
            while self._to_delete and self._db is not None:
                batch, self._to_delete = self._to_delete, []
                try:
                    await asyncio.to_thread(self._delete, batch)
                except Exception as error:  # kept on disk: republished (and deduplicated) at the next start
                    log.warning("outbox_delete_failed", error=repr(error), messages=len(batch))
        finally:
            self._deleting = False

    async def _run(self) -> None:
        while True:
            msg_id, subject, data = await self._ready.get()
            self._start_delivery(msg_id, subject, data)

    def _start_delivery(self, msg_id: str, subject: str, data: bytes,
                        written: asyncio.Future[None] | None = None) -> None:
        if msg_id in self._in_flight:
            return
        self._in_flight.add(msg_id)
        task = asyncio.ensure_future(self._deliver(msg_id, subject, data, written))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, msg_id: str, subject: str, data: bytes, written: asyncio.Future[None] | None) -> None:
        delay = self._retry_min_s
        tries = 0
        try:
            while True:
                try:
                    await self._publish(subject, data, msg_id)
                    break
                except Exception as error:
                    tries += 1
                    if tries == 1 or tries % 20 == 0:
                        log.warning("outbox_publish_retrying", msg_id=msg_id, tries=tries, error=repr(error))
                    await asyncio.sleep(delay)
                    delay = min(self._retry_max_s, delay * 2)
            if written is not None:
                try:
                    await asyncio.shield(written)  # delete only what is on disk
                except Exception:
                    return  # never written (the caller was told): nothing to delete
            self._to_delete.append(msg_id)
            if not self._deleting:
                self._deleting = True
                task = asyncio.ensure_future(self._delete_acknowledged())
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)
        finally:
            self._in_flight.discard(msg_id)

    async def drained(self, timeout: float) -> bool:
        """Wait until nothing is pending (or `timeout`); True if everything was acknowledged."""
        deadline = time.monotonic() + timeout
        while self._in_flight or self._to_write or self._to_delete or self._deleting or not self._ready.empty():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        """Stop publishing; what is still pending stays on disk for the next start."""
        for task in [*self._deliveries, *([self._task] if self._task else [])]:
            task.cancel()
        if self._deliveries:
            await asyncio.wait(self._deliveries, timeout=5)
        if self._to_delete and self._db is not None:  # acknowledged, delete not committed yet
            deletes, self._to_delete = self._to_delete, []
            try:
                await asyncio.to_thread(self._delete, deletes)
            except Exception as error:  # republished (and deduplicated) at the next start
                log.warning("outbox_delete_failed", error=repr(error), messages=len(deletes))
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.to_thread(self._close, db)

    def _close(self, db: sqlite3.Connection) -> None:
        with self._lock:
            db.close()
