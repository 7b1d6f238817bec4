"""The end of a batch: completed (every line has a result), expired (its window passed) or
cancelled (the gateway asked). Lines still out are cancelled, the output and error files written
in input order, and the final record written.

What ends how is decided by pure code: `lifecycle` (the record's changes, which lines a completing
batch lost) and `lines.final_lines` (the files' lines and the usage). This is the shell that
cancels, reads the results stream, writes the files and the record.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from inferbus.runtime import logs
from proto import messages as m
from proto import subjects

from . import lifecycle
from . import lines as line_format
from .metrics import FINISHED
from .validate import Validated

if TYPE_CHECKING:
    from nats.aio.client import Client

    from inferbus.stores.files import FileStore

    from .result_stream import ResultStream
    from .settings import BatchSettings
    from .tracker import ActiveBatch, Tracker

log = logs.get(__name__)


class Finishing(Protocol):
    """What finishing a batch may touch of the batch service: the bus (cancels), the files, the
    lines it tracks and their results, and its steps that index a file, track and untrack a batch
    and write its record."""

    @property
    def id(self) -> str: ...
    @property
    def settings(self) -> BatchSettings: ...
    @property
    def nc(self) -> Client | None: ...
    @property
    def files(self) -> FileStore | None: ...
    @property
    def tracker(self) -> Tracker: ...
    @property
    def results(self) -> ResultStream: ...

    def validate_file(self, source: m.FileRecord, endpoint: str,
                      check_model: Callable[[str], str | None]) -> Validated | list[m.BatchErrorEntry]: ...
    async def track(self, record: m.BatchRecord, verdict: Validated, resumed: bool) -> ActiveBatch | None: ...
    async def untrack(self, batch_id: str) -> None: ...
    async def update_record(self, record: m.BatchRecord,
                            change: Callable[[m.BatchRecord], m.BatchRecord | None]) -> m.BatchRecord | None: ...


class Finisher:
    def __init__(self, service: Finishing) -> None:
        self.service = service

    async def finish(self, record: m.BatchRecord, outcome: lifecycle.Outcome) -> None:
        """Write the output and error files and the final record. `outcome`: completed (every line
        has a result), expired (the window passed) or cancelled (the gateway asked)."""
        service = self.service
        run = service.tracker.runs.get(record.id)
        if run is None and lifecycle.indexes_to_finish(record):
            # Not tracked by this process (a restart mid-finalize or mid-cancel): index the file.
            assert service.files is not None
            source = await service.files.get(record.tenant, record.input_file_id)
            verdict = (await asyncio.to_thread(service.validate_file, source, record.endpoint, lambda model: None)
                       if source is not None else [])
            if isinstance(verdict, Validated):
                run = await service.track(record, verdict, resumed=True)
        if outcome != "completed":
            await self._stop_lines(run, lifecycle.cancel_reason(outcome))
        elif run is not None:
            service.tracker.stop_feeding(run.id)
        custom_ids = run.custom_ids if run is not None else []
        results = await service.results.read(record.id) if custom_ids else {}
        lost = lifecycle.lost_lines(outcome, len(custom_ids), results)
        if lost and run is not None:
            await self._reopen(record, run, results, lost)
            return
        if outcome == "completed" and record.status == "in_progress":
            now = int(time.time())
            updated = await service.update_record(record, lambda current: lifecycle.finalizing(current, now))
            if updated is None or updated.status != "finalizing":
                return  # cancelled meanwhile: that path finishes it
            record = updated
        final = line_format.final_lines(record, custom_ids, results, expired=outcome == "expired")
        assert service.files is not None
        output_file = error_file = None
        if final.outputs:
            output_file = (await service.files.write(record.tenant, f"{record.id}_output.jsonl", "batch_output",
                                                     final.outputs)).id
        if final.errors:
            error_file = (await service.files.write(record.tenant, f"{record.id}_error.jsonl", "batch_output",
                                                    final.errors)).id
        now = int(time.time())
        updated = await service.update_record(record, lambda current: lifecycle.final(
            current, outcome, completed=len(final.outputs), failed_lines=len(final.errors), usage=final.usage,
            output_file_id=output_file, error_file_id=error_file, now=now))
        await service.untrack(record.id)
        FINISHED.labels(outcome).inc()
        log.info("batch_finished", status=updated.status if updated else None, outcome=outcome,
                 completed=len(final.outputs), failed=len(final.errors), output_file_id=output_file,
                 error_file_id=error_file, input_tokens=final.usage.input_tokens,
                 output_tokens=final.usage.output_tokens)

    async def _reopen(self, record: m.BatchRecord, run: ActiveBatch, results: dict[int, m.BatchLineResult],
                      lost: list[int]) -> None:
        """Results this process counted are not in the stream (a NATS server killed hard loses its
        last writes): the stream is the record of what ended, so those lines run again."""
        log.warning("batch_results_lost", lines=len(lost), first=lost[:5])
        if record.status == "finalizing":
            await self.service.update_record(record, lifecycle.reopened)
        self.service.tracker.reopen(run.id, list(results.values()), lost)

    async def _stop_lines(self, run: ActiveBatch | None, reason: str) -> None:
        """Publish nothing more; cancel lines out in the fleet and wait (briefly) for their results."""
        nc = self.service.nc
        assert nc is not None
        if run is None:
            return
        out = self.service.tracker.stop_feeding(run.id)
        # A line in doubt after a restart may run somewhere too: cancel every line without a result.
        lines = [line for line in range(run.total) if line not in run.done]
        for line in lines:
            request_id = m.batch_request_id(run.id, line)
            cancel = m.Cancel(request_id=request_id, reason=reason)  # type: ignore[arg-type]
            await nc.publish(subjects.cancel_subject(f"batch-{self.service.id}", request_id), m.encode(cancel))
        log.info("batch_lines_cancelled", reason=reason, in_flight=len(out), without_result=len(lines))
        deadline = time.monotonic() + self.service.settings.cancel_grace_s
        while run.outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
