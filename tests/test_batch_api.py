"""The Files and Batch APIs as a tenant's code sees them (official openai SDK), and the stores under
them (`FileStore`, `BatchStore`) against the platform's real NATS.

The batch service may be running in the platform and move a batch on from `validating`: what the
gateway alone decides is asserted exactly, the rest as the set of statuses it may have reached.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import nats
import openai
import pytest
from nats.js.api import KeyValueConfig

from inferbus.bus import connection as bus
from inferbus.openai.objects import batch_object, file_object
from inferbus.stores.batches import BatchStore, new_batch_id
from inferbus.stores.files import FileStore, FileTooLarge, new_file_id
from proto import messages as m
from services.gateway.batches_api import NotCancellable, cancel

from .conftest import MODEL, Platform

pytestmark = pytest.mark.e2e

STATUSES = {"validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"}


def new_tenant(platform: Platform) -> tuple[str, openai.OpenAI]:
    """A fresh tenant (so listings hold only this test's objects) and an SDK client with its key."""
    tenant, key = platform.new_tenant()
    return tenant, platform.client(api_key=key, timeout=30)


def jsonl(n: int, max_tokens: int = 5) -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": max_tokens},
        }
        for i in range(n)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def metric(platform: Platform, sample: str) -> float:
    """The value of one sample (name with its labels, as exposed) on the gateway's /metrics; 0 if absent."""
    text = httpx.get(platform.stack.gateway_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " "))


# ---- Files API ---------------------------------------------------------------------------------


def test_upload_retrieve_list_download_and_delete(platform: Platform) -> None:
    _, client = new_tenant(platform)
    # Larger than one read/flush chunk, with every byte value: the download must be byte-identical.
    data = bytes(range(256)) * 4096 + os.urandom(3 * 1024 * 1024 + 17)
    uploaded_bytes = metric(platform, "inferbus_files_uploaded_bytes_total")
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    assert metric(platform, "inferbus_files_uploaded_bytes_total") == uploaded_bytes + len(data)
    assert re.fullmatch(r"file-[0-9a-f]{32}", uploaded.id)
    assert (uploaded.object, uploaded.bytes, uploaded.filename, uploaded.purpose, uploaded.status) == (
        "file", len(data), "input.jsonl", "batch", "processed")
    assert abs(uploaded.created_at - time.time()) < 60

    assert client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).read() == data

    second = client.files.create(file=("second.jsonl", jsonl(2)), purpose="batch")
    newest_first = [second, uploaded]
    page = client.files.list()
    assert [f.id for f in page.data] == [f.id for f in newest_first]
    assert page.has_more is False
    assert [f.id for f in client.files.list(order="asc").data] == [f.id for f in reversed(newest_first)]
    assert [f.id for f in client.files.list(purpose="batch").data] == [f.id for f in newest_first]
    assert client.files.list(purpose="batch_output").data == []
    first_page = client.files.list(limit=1)
    assert [f.id for f in first_page.data] == [newest_first[0].id] and first_page.has_more is True
    assert [f.id for f in client.files.list(limit=1, after=newest_first[0].id).data] == [newest_first[1].id]
    assert [f.id for f in client.files.list(limit=1)] == [f.id for f in newest_first]  # the SDK's auto-paging

    deleted = client.files.delete(uploaded.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (uploaded.id, "file", True)
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(uploaded.id)
    assert [f.id for f in client.files.list().data] == [second.id]


def test_another_tenant_cannot_see_download_delete_or_batch_a_file(platform: Platform) -> None:
    _, owner = new_tenant(platform)
    _, other = new_tenant(platform)
    uploaded = owner.files.create(file=("mine.jsonl", jsonl(1)), purpose="batch")
    batch = owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(uploaded.id)
    with pytest.raises(openai.NotFoundError) as raised:
        other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert raised.value.body["param"] == "input_file_id"  # type: ignore[index]
    for batch_call in (other.batches.retrieve, other.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            batch_call(batch.id)
    assert other.files.list().data == [] and other.batches.list().data == []
    # The owner still has both.
    assert owner.files.content(uploaded.id).read() == jsonl(1)
    assert owner.batches.retrieve(batch.id).id == batch.id


def test_upload_errors_are_openai_errors(platform: Platform) -> None:
    _, client = new_tenant(platform)
    with pytest.raises(openai.BadRequestError) as raised:
        client.files.create(file=("x.jsonl", jsonl(1)), purpose="fine-tune")
    assert raised.value.body["param"] == "purpose"  # type: ignore[index]
    assert raised.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.files.create(file=("empty.jsonl", b""), purpose="batch")
    assert raised.value.body["param"] == "file"  # type: ignore[index]
    key = client.api_key
    with httpx.Client(base_url=platform.base_url, headers={"authorization": f"Bearer {key}"}, timeout=10) as http:
        missing_file = http.post("/files", data={"purpose": "batch"}, files={"other": ("x", b"abc")})
        assert missing_file.status_code == 400 and missing_file.json()["error"]["param"] == "file"
        missing_purpose = http.post("/files", files={"file": ("x.jsonl", b"abc")})
        assert missing_purpose.status_code == 400 and missing_purpose.json()["error"]["param"] == "purpose"
        not_multipart = http.post("/files", json={"purpose": "batch"})
        assert not_multipart.status_code == 400 and set(not_multipart.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        bad_limit = http.get("/files", params={"limit": 0})
        assert bad_limit.status_code == 400 and bad_limit.json()["error"]["param"] == "limit"
        bad_order = http.get("/files", params={"order": "sideways"})
        assert bad_order.status_code == 400 and bad_order.json()["error"]["param"] == "order"
        unauthenticated = httpx.get(platform.base_url + "/files", timeout=10)
        assert unauthenticated.status_code == 401
        # The purpose may come after the file (the SDK sends it first): refused or kept at the end.
        for purpose, status in (("fine-tune", 400), ("batch", 200)):
            body = (b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="late.jsonl"\r\n'
                    b"Content-Type: application/jsonl\r\n\r\nline one\nline two\n\r\n"
                    b'--b0undary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n' + purpose.encode() +
                    b"\r\n--b0undary--\r\n")
            late = http.post("/files", content=body, headers={"content-type": "multipart/form-data; boundary=b0undary"})
            assert late.status_code == status, late.text
        kept = late.json()
        assert (kept["filename"], kept["bytes"], kept["purpose"]) == ("late.jsonl", 18, "batch")
        assert client.files.content(kept["id"]).read() == b"line one\nline two\n"
        client.files.delete(kept["id"])
        # A body cut before its closing boundary (with or without the last CRLF): refused, nothing kept.
        head = (b'--b0undary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="cut.jsonl"\r\n\r\n')
        for cut in (head + b"abcdefgh", head + b'{"a": 1}\n\r\n', head + b'{"a": 1}\n\r\n--b0undary'):
            truncated = http.post(
                "/files", content=cut, headers={"content-type": "multipart/form-data; boundary=b0undary"}
            )
            assert truncated.status_code == 400, truncated.text
            assert "closing boundary" in truncated.json()["error"]["message"]
    assert client.files.list().data == []  # nothing refused was kept


def test_an_upload_declared_over_the_limit_is_refused_before_its_body(platform: Platform) -> None:
    """413 from the Content-Length alone: the gateway does not read 300 MB to refuse them."""
    _, client = new_tenant(platform)
    host, port = platform.stack.gateway_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/v1/files")
    connection.putheader("authorization", f"Bearer {client.api_key}")
    connection.putheader("content-type", "multipart/form-data; boundary=xyz")
    connection.putheader("content-length", str(300 * 1024 * 1024))
    connection.endheaders()
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    assert response.status == 413
    assert body["error"]["code"] == "file_too_large" and body["error"]["type"] == "invalid_request_error"


# ---- Batches API -------------------------------------------------------------------------------


def test_create_retrieve_and_cancel_a_batch(platform: Platform) -> None:
    _, client = new_tenant(platform)
    source = client.files.create(file=("in.jsonl", jsonl(2, max_tokens=2000)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly", "k" * 64: "v" * 512})
    assert re.fullmatch(r"batch_[0-9a-f]{32}", batch.id)
    assert (batch.object, batch.status, batch.endpoint, batch.input_file_id, batch.completion_window) == (
        "batch", "validating", "/v1/chat/completions", source.id, "24h")
    assert batch.expires_at == batch.created_at + 24 * 3600
    assert batch.metadata == {"job": "nightly", "k" * 64: "v" * 512}
    assert batch.request_counts is not None and batch.request_counts.total == 0
    assert batch.errors is None and batch.output_file_id is None

    again = client.batches.retrieve(batch.id)
    assert (again.id, again.input_file_id, again.metadata, again.created_at) == (
        batch.id, source.id, batch.metadata, batch.created_at)
    assert again.status in STATUSES

    # 2000-token lines cannot have finished yet: the batch is validating or running, so cancelling.
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert client.batches.retrieve(batch.id).status in {"cancelling", "cancelled"}
    assert client.batches.cancel(batch.id).status in {"cancelling", "cancelled"}  # again: no error, unchanged
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel(new_batch_id())
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("not-a-batch-id")


def test_list_batches_pages_newest_first(platform: Platform) -> None:
    _, client = new_tenant(platform)
    source = client.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")
    chat_batches = metric(platform, 'inferbus_batches_created_total{endpoint="/v1/chat/completions"}')
    created = [client.batches.create(input_file_id=source.id, endpoint="/v1/completions" if i % 2 else
                                     "/v1/chat/completions", completion_window="24h") for i in range(5)]
    expected = [b.id for b in sorted(created, key=lambda b: (b.created_at, b.id), reverse=True)]
    assert expected == [b.id for b in reversed(created)]  # ids sort in creation order, within a second too
    assert metric(platform, 'inferbus_batches_created_total{endpoint="/v1/chat/completions"}') == chat_batches + 3
    walked: list[str] = []
    pages = []
    after = None
    while True:
        page = client.batches.list(limit=2, **({"after": after} if after else {}))
        pages.append((len(page.data), page.has_more))
        walked += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert walked == expected
    assert pages == [(2, True), (2, True), (1, False)]
    raw = client.batches.with_raw_response.list(limit=2).http_response.json()
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == ("list", expected[0], expected[1], True)
    assert [b.id for b in client.batches.list(limit=2)] == expected  # the SDK's auto-paging
    assert [b.id for b in client.batches.list().data] == expected  # default limit 20
    with pytest.raises(openai.BadRequestError) as raised:
        client.batches.list(limit=101)
    assert raised.value.body["param"] == "limit"  # type: ignore[index]


def test_batch_create_errors(platform: Platform) -> None:
    tenant, client = new_tenant(platform)
    source = client.files.create(file=("in.jsonl", jsonl(1)), purpose="batch")

    def refused(error: type[openai.APIStatusError], **fields: object) -> dict:
        arguments = {
            "input_file_id": source.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **fields,
        }
        with pytest.raises(error) as raised:
            client.batches.create(**arguments)  # type: ignore[arg-type]
        return raised.value.body  # type: ignore[return-value]

    assert refused(openai.BadRequestError, endpoint="/v1/embeddings")["param"] == "endpoint"
    assert refused(openai.BadRequestError, completion_window="48h")["param"] == "completion_window"
    assert refused(openai.NotFoundError, input_file_id=new_file_id())["param"] == "input_file_id"
    assert refused(openai.BadRequestError, metadata={str(i): "v" for i in range(17)})["param"] == "metadata"
    assert refused(openai.BadRequestError, metadata={"k": "v" * 513})["param"] == "metadata"
    assert refused(openai.BadRequestError, metadata={"k" * 65: "v"})["param"] == "metadata"

    # A file of the tenant's whose purpose is not `batch` (as the batch service writes outputs).
    output = asyncio.run(_put_file_record(platform, tenant, "batch_output"))
    body = refused(openai.BadRequestError, input_file_id=output.id)
    assert body["param"] == "input_file_id" and "purpose" in body["message"]
    assert client.batches.list().data == []  # nothing refused was created


async def _put_file_record(platform: Platform, tenant: str, purpose: str) -> m.FileRecord:
    nc = await nats.connect(platform.stack.nats_url)
    try:
        _, files_kv = await bus.batch_buckets(nc.jetstream())
        record = m.FileRecord(id=new_file_id(), tenant=tenant, bytes=1, created_at=int(time.time()),
                              filename="out.jsonl", purpose=purpose)
        await files_kv.create(f"{tenant}.{record.id}", m.encode(record))
        return record
    finally:
        await nc.close()


def test_cancelling_a_finished_batch_is_a_409_like_openai(platform: Platform) -> None:
    tenant, client = new_tenant(platform)

    async def finished_batch() -> str:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            batches_kv, _ = await bus.batch_buckets(nc.jetstream())
            now = int(time.time())
            record = m.BatchRecord(id=new_batch_id(), tenant=tenant, endpoint="/v1/chat/completions",
                                   input_file_id=new_file_id(), completion_window="24h", created_at=now,
                                   expires_at=now + 86400, status="completed", completed_at=now, total=3, completed=3)
            await BatchStore(batches_kv).create(record)
            return record.id
        finally:
            await nc.close()

    batch_id = asyncio.run(finished_batch())
    with pytest.raises(openai.ConflictError) as raised:
        client.batches.cancel(batch_id)
    assert raised.value.message.endswith("Cannot cancel a batch with status 'completed'.")
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert client.batches.retrieve(batch_id).status == "completed"


def test_cancel_transitions() -> None:
    record = m.BatchRecord(id=new_batch_id(), tenant="t", endpoint="/v1/completions", input_file_id=new_file_id(),
                           completion_window="24h", created_at=100, expires_at=86500)
    for status in ("validating", "in_progress"):
        after = cancel(msgspec.structs.replace(record, status=status), 123.9)
        assert after is not None and (after.status, after.cancelling_at) == ("cancelling", 123)
    for status in ("cancelling", "cancelled"):
        assert cancel(msgspec.structs.replace(record, status=status), 123.0) is None
    for status in ("finalizing", "completed", "failed", "expired"):
        with pytest.raises(NotCancellable):
            cancel(msgspec.structs.replace(record, status=status), 123.0)


def test_objects_parse_with_the_sdk_types() -> None:
    from openai.types import Batch, FileObject

    record = m.BatchRecord(id=new_batch_id(), tenant="t", endpoint="/v1/completions", input_file_id=new_file_id(),
                           completion_window="24h", created_at=100, expires_at=86500, status="failed", failed_at=101,
                           errors=[m.BatchErrorEntry(code="invalid_json", message="Line 3 is not JSON.", line=3)],
                           usage=m.BatchUsage(input_tokens=10, cached_tokens=4, output_tokens=5), total=3, failed=1)
    batch = Batch.model_validate(batch_object(record))
    assert batch.errors is not None and batch.errors.data is not None
    assert (batch.errors.data[0].code, batch.errors.data[0].line) == ("invalid_json", 3)
    assert batch.usage is not None and (batch.usage.total_tokens, batch.usage.input_tokens_details.cached_tokens) == (
        15,
        4,
    )
    assert batch.request_counts is not None and (batch.request_counts.total, batch.request_counts.failed) == (3, 1)
    assert batch.model is None
    file = FileObject.model_validate(file_object(m.FileRecord(id=new_file_id(), tenant="t", bytes=3, created_at=5,
                                                              filename="o.jsonl", purpose="batch_output")))
    assert (file.purpose, file.status, file.expires_at) == ("batch_output", "processed", None)


# ---- the stores, on the platform's NATS --------------------------------------------------------


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_file_store_limits_writes_lines_lists_and_deletes(platform: Platform, tmp_path: Path) -> None:
    nc = await nats.connect(platform.stack.nats_url)
    try:
        _, files_kv = await bus.batch_buckets(nc.jetstream())
        store = FileStore(tmp_path, files_kv, max_bytes=20)
        tenant = "t-" + secrets.token_hex(4)
        with pytest.raises(FileTooLarge):
            await store.create(tenant, "big.jsonl", "batch", _chunks(b"1234567890", b"12345678901"))
        assert list((tmp_path / tenant).iterdir()) == []  # no bytes kept, not even a temporary file
        assert await store.list(tenant) == ([], False)

        exact = await store.create(tenant, "twenty.jsonl", "batch", _chunks(b"1234567890", b"1234567890"))
        assert (exact.bytes, exact.filename, exact.purpose) == (20, "twenty.jsonl", "batch")
        assert store.path(exact) == tmp_path / tenant / exact.id and store.path(exact).read_bytes() == b"1234567890" * 2
        from_file = await store.create(tenant, "f.jsonl", "batch", io.BytesIO(b'{"a":1}\r\n\n{"b":2}'))
        assert await store.get(tenant, from_file.id) == from_file
        assert await store.get("t-someone-else", from_file.id) is None
        assert await store.get(tenant, "file-../../etc") is None
        assert list(store.iter_lines(from_file)) == [(0, b'{"a":1}'), (1, b""), (2, b'{"b":2}')]
        assert [item async for item in store.aiter_lines(from_file, lines_per_read=2)] == list(
            store.iter_lines(from_file)
        )

        # Generated files have no size limit and one line per item.
        output = await store.write(tenant, "batch_x_output.jsonl", "batch_output", [b'{"x":1}', b'{"y":2}\n'] * 10)
        assert store.path(output).read_bytes() == b'{"x":1}\n{"y":2}\n' * 10
        assert [i for i, _ in store.iter_lines(output)] == list(range(20))

        everything = sorted([exact, from_file, output], key=lambda r: (r.created_at, r.id), reverse=True)
        assert await store.list(tenant) == (everything, False)
        assert await store.list(tenant, purpose="batch_output") == ([output], False)
        assert await store.list(tenant, limit=2) == (everything[:2], True)
        assert await store.list(tenant, after=everything[1].id) == (everything[2:], False)
        assert await store.list(tenant, order="asc") == (everything[::-1], False)

        assert await store.delete("t-someone-else", output.id) is False
        assert await store.delete(tenant, output.id) is True
        assert not store.path(output).exists() and await store.get(tenant, output.id) is None
        assert await store.delete(tenant, output.id) is False

        stale = tmp_path / tenant / ".tmp-file-stale"
        stale.write_bytes(b"x")
        os.utime(stale, (time.time() - 2 * 86400,) * 2)
        young = tmp_path / tenant / ".tmp-file-young"
        young.write_bytes(b"x")
        assert store.sweep_temporary() == 1 and not stale.exists() and young.exists()
    finally:
        await nc.close()


async def test_batch_store_compare_and_set_pages_active_and_watch(platform: Platform) -> None:
    # A bucket of this test's own on the platform's NATS: the running batch service watches the
    # real one and would move these records on.
    nc = await nats.connect(platform.stack.nats_url)
    js = nc.jetstream()
    bucket = f"batches_test_{secrets.token_hex(4)}"
    try:
        store = BatchStore(await js.create_key_value(KeyValueConfig(bucket=bucket, history=1)))
        tenant = "t-" + secrets.token_hex(4)

        def record(created_at: int, status: str = "validating", owner: str = tenant) -> m.BatchRecord:
            return m.BatchRecord(id=new_batch_id(), tenant=owner, endpoint="/v1/completions",
                                 input_file_id=new_file_id(), completion_window="24h", created_at=created_at,
                                 expires_at=created_at + 86400, status=status)

        # A watch without the existing records: `before` is never seen; probes (another tenant's)
        # are written until the watch has begun, then ours arrive, each put in order.
        before = record(999)
        await store.create(before)
        watch = store.watch(existing=False)
        first = asyncio.ensure_future(anext(watch))
        while not first.done():
            await store.create(record(999, owner="t-probe"))
            await asyncio.wait({first}, timeout=0.2)
        assert first.result().tenant == "t-probe"
        records = [record(1000 + i) for i in range(4)] + [record(1000, "completed")]
        for r in records:
            await store.create(r)
        ours: list[m.BatchRecord] = []
        while len(ours) < len(records):
            put = await asyncio.wait_for(anext(watch), 10)
            if put.tenant == tenant:  # (the last probes' puts may come after the first)
                ours.append(put)
        assert ours == records
        await watch.aclose()
        # With the existing records: every current value first (ours, and `before`).
        replay = store.watch()
        replayed = []
        while not all(r in replayed for r in [before, *records]):
            replayed.append(await asyncio.wait_for(anext(replay), 10))
        await replay.aclose()
        await store.kv.delete(f"{tenant}.{before.id}")

        assert await store.get(tenant, records[0].id) == records[0]
        assert await store.get("t-someone-else", records[0].id) is None
        assert await store.get(tenant, before.id) is None  # deleted
        newest_first = sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)
        assert await store.list(tenant, limit=3) == (newest_first[:3], True)
        assert await store.list(tenant, after=newest_first[2].id, limit=3) == (newest_first[3:], False)
        assert [r.id for r in await store.active() if r.tenant == tenant] == [r.id for r in records[:4]]  # oldest first

        # 20 concurrent read-modify-writes on one record: compare-and-set loses none of them.
        target = records[0]

        def bump(r: m.BatchRecord) -> m.BatchRecord:
            return msgspec.structs.replace(r, completed=r.completed + 1)

        await asyncio.gather(*(store.update(tenant, target.id, bump) for _ in range(20)))
        after = await store.get(tenant, target.id)
        assert after is not None and after.completed == 20
        assert await store.update(tenant, target.id, lambda r: None) == after  # None: unchanged
        assert await store.update("t-someone-else", target.id, bump) is None
    finally:
        await js.delete_key_value(bucket)
        await nc.close()
