"""Publishing a batch line's attempt: its body read from the input file, rendered into the request
a worker runs (`lines`, pure), and published on the batch band with its dispatch record. A line
whose request cannot be built or carried ends here with its error as its result.
"""

from __future__ import annotations

import time
from typing import IO, TYPE_CHECKING, Protocol

import msgspec

from inferbus.openai.errors import OpenAIError
from inferbus.stores import dispatch_records
from inferbus.tokens.prompt import context_window
from proto import messages as m
from proto import subjects

from . import lines as line_format
from .metrics import PUBLISHED
from .tracker import publishes_next_attempt

if TYPE_CHECKING:
    from inferbus.bus.replies import Replies
    from inferbus.tokens.prompt import ServedModel

    from .result_stream import ResultStream
    from .settings import BatchSettings
    from .tracker import ActiveBatch, Tracker


class Publishing(Protocol):
    """What publishing lines may touch of the batch service: how lines render, where attempts go
    and their answers come back, the lines it tracks, and where a line's own result is recorded."""

    @property
    def settings(self) -> BatchSettings: ...
    @property
    def served(self) -> ServedModel: ...
    @property
    def reply_subject(self) -> str: ...
    @property
    def replies(self) -> Replies | None: ...
    @property
    def tracker(self) -> Tracker: ...
    @property
    def results(self) -> ResultStream: ...

    def newest_record(self, run: ActiveBatch) -> m.BatchRecord: ...


def read_bodies(wanted: list[tuple[ActiveBatch, int]]) -> list[bytes | None]:
    """The `body` of each wanted line, read from its input file by offset (None: unreadable)."""
    out: list[bytes | None] = []
    handles: dict[str, IO[bytes]] = {}
    try:
        for run, line in wanted:
            handle = handles.get(run.id)
            if handle is None:
                try:
                    handle = handles[run.id] = open(run.input_path, "rb")  # noqa: SIM115 (closed below)
                except FileNotFoundError:
                    out.append(None)
                    continue
            handle.seek(run.offsets[line])
            raw = handle.readline()
            try:
                out.append(line_format.decode_line(raw).body_bytes())
            except msgspec.MsgspecError:
                out.append(None)
    finally:
        for handle in handles.values():
            handle.close()
    return out


class LinePublisher:
    def __init__(self, service: Publishing) -> None:
        self.service = service

    async def publish(self, run: ActiveBatch, line: int, attempt: int, doubt: bool, body: bytes | None) -> None:
        service = self.service
        replies = service.replies
        assert replies is not None
        now = time.time()
        record = run.record
        if body is None:
            await service.results.publish(line_format.error_result(
                run.id, line, "input_unreadable", "The line could not be read from the input file.", 500, now))
            return
        try:
            plan = line_format.plan_line(record.endpoint, body, model=service.served,
                                         max_model_len=context_window(service.settings.max_model_len, service.served),
                                         default_max_tokens=service.settings.default_max_tokens)
        except OpenAIError as error:
            # The request itself is invalid (say, too long for the context): its line says so.
            await service.results.publish(line_format.error_result(
                run.id, line, error.code or "invalid_request", error.message, error.status, now))
            return
        subject = subjects.request_subject("batch", run.base_model, subjects.ANY_TARGET, service.reply_subject)
        while True:
            request = line_format.line_request(
                plan, batch_id=run.id, line=line, tenant=record.tenant, api_key_id=record.api_key_id,
                base_model=run.base_model, adapter=run.adapter,
                deadline=float(service.newest_record(run).expires_at),
                now=now, reply_to=service.reply_subject, attempt=attempt,
            )
            try:
                payload = line_format.encode_request(request)
            except OpenAIError as error:  # no retry can publish it: the line fails, the batch goes on
                await service.results.publish(line_format.error_result(
                    run.id, line, error.code or "invalid_request", error.message, error.status, now))
                return
            await dispatch_records.publish(replies, request)
            stored = await replies.publish_durable(subject, payload, f"{request.request_id}.{attempt}")
            if not publishes_next_attempt(stored=stored, doubt=doubt, attempt=attempt):
                break
            attempt += 1
        service.tracker.published(run, line, attempt)
        PUBLISHED.labels("doubt" if doubt else ("retry" if attempt else "new")).inc()
