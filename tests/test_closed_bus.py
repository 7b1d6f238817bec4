"""The bus is closed: against the platform's real nats-server and Redis, a client without
credentials, or with a worker's, can neither read another tenant's stream, nor inject a request,
nor cancel another gateway's request; the platform works normally with its own credentials."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import nats
import pytest
import redis
from nats.aio.client import Client
from nats.js.api import StreamConfig

from inferbus.bus.auth import Identity, inbox_prefix, permissions
from inferbus.bus.connection import BusSettings
from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, dispatch

pytestmark = pytest.mark.e2e


class Connection:
    """A client of the platform's NATS as one identity, recording the server's permission errors."""

    def __init__(self, platform: Platform, identity: Identity | None) -> None:
        self.platform, self.identity = platform, identity
        self.errors: list[str] = []

    async def __aenter__(self) -> Client:
        async def on_error(error: Exception) -> None:
            self.errors.append(str(error))

        options: dict[str, object] = {}
        if self.identity is not None:
            options = BusSettings(user=self.identity.user, password=self.identity.password).options("nats://")
        self.nc = await nats.connect(self.platform.stack.nats_server_url, error_cb=on_error, allow_reconnect=False,
                                     **options)  # type: ignore[arg-type]
        return self.nc

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    def denied(self, verb: str, subject: str) -> bool:
        # nats-py reports the server's error lower-cased.
        return any("permissions violation" in e.lower() and verb in e.lower() and subject.lower() in e.lower()
                   for e in self.errors)


def collect(seen: list[str]):  # type: ignore[no-untyped-def]
    async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(msg.subject)

    return on_message


def identity(platform: Platform, name: str) -> Identity:
    assert platform.stack.identities is not None, "the test platform runs its own, closed, NATS"
    return platform.stack.identities[name]


def a_request(reply_to: str, tenant: str = "demo") -> m.InferenceRequest:
    return m.InferenceRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", tenant=tenant, api_key_id="forged", model=MODEL,
        band="standard", prompt="forged", sampling=m.SamplingParams(max_new_tokens=5), reply_to=reply_to,
        created=time.time(), deadline=time.time() + 60,
    )


def test_a_client_without_credentials_is_refused(platform: Platform) -> None:
    async def run() -> None:
        with pytest.raises(Exception) as refused:
            async with Connection(platform, None):
                pass
        assert "authorization" in repr(refused.value).lower() or "no servers" in repr(refused.value).lower()

    asyncio.run(run())
    with pytest.raises(redis.AuthenticationError):
        host, port = platform.stack.redis_url.rsplit("@", 1)[1].split("/")[0].split(":")
        redis.Redis(host=host, port=int(port)).get("anything")


def test_a_worker_can_read_neither_requests_nor_other_gateways_tokens(platform: Platform) -> None:
    """While a real request streams, a worker's identity subscribed to every request and token
    subject sees nothing, and the server reports the violations."""

    async def run() -> tuple[list[str], Connection]:
        seen: list[str] = []
        worker = Connection(platform, identity(platform, "worker-1"))
        async with worker as nc:
            for wildcard in (f"{subjects.PREFIX}.req.>", f"{subjects.PREFIX}.tok.>", f"{subjects.PREFIX}.usage.>"):
                await nc.subscribe(wildcard, cb=collect(seen))
            await nc.flush()
            reply = await platform.async_client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a secret prompt"}], max_tokens=8)
            assert reply.choices[0].message.content
            await nc.flush()
            await asyncio.sleep(0.3)
        return seen, worker

    seen, worker = asyncio.run(run())
    assert seen == []
    assert worker.denied("subscription", f"{subjects.PREFIX}.req.>")
    assert worker.denied("subscription", f"{subjects.PREFIX}.tok.>")


def test_a_worker_cannot_read_a_stream_through_jetstream_nor_purge_one(platform: Platform) -> None:
    async def run() -> Connection:
        worker = Connection(platform, identity(platform, "worker-1"))
        async with worker as nc:
            js = nc.jetstream(timeout=1.0)
            attempts = [
                # A stream of its own that would capture every gateway's tokens.
                js.add_stream(StreamConfig(name="SNOOP", subjects=[f"{subjects.PREFIX}.tok.>"])),
                # The ledger and batch results: not a worker's to read.
                js.subscribe(subjects.usage_stream_subjects()[0], stream=subjects.USAGE_STREAM, ordered_consumer=True),
                js.subscribe(subjects.batch_results_stream_subjects()[0], stream=subjects.BATCH_RESULTS_STREAM,
                             ordered_consumer=True),
                js.purge_stream(subjects.REQUESTS_STREAM),
                js.delete_stream(subjects.USAGE_STREAM),
                # Queued requests read by sequence, past its consumers; another worker's consumer deleted.
                js.get_msg(subjects.REQUESTS_STREAM, 1),
                js.get_msg(subjects.REQUESTS_STREAM, 1, direct=True),
                js.delete_consumer(subjects.REQUESTS_STREAM, subjects.request_consumer("standard", MODEL, "worker-2")),
            ]
            for attempt in attempts:
                with pytest.raises(Exception):  # noqa: B017 (nats.py raises several kinds)
                    await attempt
        return worker

    worker = asyncio.run(run())
    assert worker.denied("publish", "$JS.API.STREAM.CREATE.SNOOP")
    assert worker.denied("publish", "$JS.API.STREAM.PURGE.REQUESTS")
    assert worker.denied("publish", "$JS.API.STREAM.MSG.GET.REQUESTS")
    assert worker.denied("publish", "$JS.API.CONSUMER.DELETE.REQUESTS.")

    async def streams() -> list[str]:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            return [s.config.name for s in await nc.jetstream().streams_info()]  # type: ignore[misc]
        finally:
            await nc.close()

    names = asyncio.run(streams())
    assert "SNOOP" not in names and subjects.USAGE_STREAM in names


def test_a_worker_cannot_inject_a_request_nor_cancel_one(platform: Platform) -> None:
    """What an injected request or cancel would have reached: an `ops` subscriber on the same
    subjects receives nothing."""

    async def run() -> tuple[list[str], Connection]:
        seen: list[str] = []
        ops = await nats.connect(platform.stack.nats_url)
        await ops.subscribe(f"{subjects.PREFIX}.req.>", cb=collect(seen))
        await ops.subscribe(f"{subjects.PREFIX}.cancel.>", cb=collect(seen))
        await ops.flush()
        worker = Connection(platform, identity(platform, "worker-1"))
        async with worker as nc:
            forged = a_request(subjects.token_subject("gateway"))
            for band in ("premium", "standard"):
                await nc.publish(
                    subjects.request_subject(band, MODEL, subjects.ANY_TARGET, forged.reply_to),  # type: ignore[arg-type]
                    m.encode(forged),
                )
            await nc.publish(
                subjects.cancel_subject("gateway", forged.request_id), m.encode(m.Cancel(forged.request_id))
            )
            await nc.flush()
            await asyncio.sleep(0.3)
        await ops.close()
        return seen, worker

    seen, worker = asyncio.run(run())
    assert seen == []
    assert worker.denied("publish", subjects.request_subject("standard", MODEL, subjects.ANY_TARGET,
                                                             subjects.token_subject("gateway")))
    assert worker.denied("publish", f"{subjects.PREFIX}.cancel.gateway.")


def test_a_gateway_cannot_make_a_worker_stream_another_gateways_tokens(platform: Platform) -> None:
    """A request names where its tokens go (`reply_to`). A gateway's identity may publish requests
    only on subjects that name itself as the owner, and a worker runs a request only when its
    reply_to is that owner's: a gateway cannot have a worker stream to another gateway's subject
    (to corrupt its clients' streams), nor, with the same trick, anywhere else. The control: the
    same gateway's request with its own reply_to does run (its events reach its token subject)."""
    own_subject, other_subject = subjects.token_subject("gateway"), subjects.token_subject("another-gateway")

    async def forge_as_gateway() -> tuple[list[str], list[str], Connection, str]:
        own_events: list[str] = []
        other_events: list[str] = []
        ops = await nats.connect(platform.stack.nats_url)
        await ops.subscribe(f"{own_subject}.*", cb=collect(own_events))
        await ops.subscribe(f"{other_subject}.*", cb=collect(other_events))
        await ops.flush()
        gateway = Connection(platform, identity(platform, "gateway"))
        async with gateway as nc:
            js = nc.jetstream()
            honest, forged = a_request(own_subject), a_request(other_subject)
            await dispatch(js, honest)  # what the gateway does before it queues a request
            # On its own subject, with another gateway's reply_to: JetStream takes it, the worker refuses it.
            await js.publish(subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, own_subject),
                             m.encode(forged))
            # On a subject naming the other gateway: the server refuses the publish itself.
            await nc.publish(subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, other_subject),
                             m.encode(forged))
            await js.publish(subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, own_subject),
                             m.encode(honest))
            deadline = time.monotonic() + 20
            while not own_events and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # the forged one was queued first: its events would be here by now
        await ops.close()
        return own_events, other_events, gateway, forged.request_id

    own_events, other_events, gateway, forged_id = asyncio.run(forge_as_gateway())
    assert own_events, "the gateway's honest request never ran: the test proves nothing"
    assert other_events == []
    assert gateway.denied("publish", subjects.request_subject("standard", MODEL, subjects.ANY_TARGET, other_subject))
    refused = [line for name in ("worker-1", "worker-2")
               for line in platform.stack.get(name).log_path.read_text(errors="replace").splitlines()
               if '"request_not_owner"' in line and forged_id in line]
    assert refused, "no worker saw the forged request"


def test_request_subjects_bind_the_reply_owner() -> None:
    own = subjects.request_subject("standard", "m.1", subjects.worker_target("w1"), subjects.token_subject("gw.1"))
    assert own == "inferbus.req.standard.m%2E1.w.w1.gw%2E1"
    assert subjects.request_reply_allowed(own, subjects.token_subject("gw.1"))
    assert not subjects.request_reply_allowed(own, subjects.token_subject("gw"))
    assert not subjects.request_reply_allowed(own, "inferbus.tok.gw%2E1.extra")
    assert subjects.shared_request_subject(own) == "inferbus.req.standard.m%2E1.any.gw%2E1"
    assert subjects.worker_of_request_subject(own) == "w1"
    assert (
        subjects.worker_of_request_subject(subjects.request_filter("standard", "m.1", subjects.worker_target("w1")))
        == "w1"
    )
    gateway = permissions("gateway", "gateway-a", "a").publish
    assert "inferbus.req.>" not in gateway
    assert set(subjects.owned_request_wildcards("a")) <= set(gateway)


def test_a_gateway_cannot_cancel_another_gateways_request(platform: Platform) -> None:
    """The gateway's identity may publish cancels for its own requests only; and a cancel that
    names another gateway (as an identity shared by several gateways could send) does not cut a
    stream: the request streams to its end."""

    async def forge_as_gateway() -> tuple[list[str], Connection]:
        seen: list[str] = []
        ops = await nats.connect(platform.stack.nats_url)
        await ops.subscribe(f"{subjects.PREFIX}.cancel.>", cb=collect(seen))
        await ops.flush()
        gateway = Connection(platform, identity(platform, "gateway"))
        async with gateway as nc:
            await nc.publish(subjects.cancel_subject("another-gateway", "chatcmpl-x"), m.encode(m.Cancel("chatcmpl-x")))
            await nc.flush()
            await asyncio.sleep(0.3)
        await ops.close()
        return seen, gateway

    seen, gateway = asyncio.run(forge_as_gateway())
    assert seen == [] and gateway.denied("publish", f"{subjects.PREFIX}.cancel.another-gateway.")

    async def cancel_from_elsewhere() -> tuple[str | None, int, str]:
        ops = await nats.connect(platform.stack.nats_url)
        client = platform.async_client()
        async with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "tell me a long story"}], max_tokens=400,
                stream=True) as response:
            request_id = response.headers["x-request-id"]
            finish, chunks = None, 0
            async for chunk in await response.parse():
                chunks += 1
                if chunks == 2:
                    forged = m.Cancel(request_id, reason="admin")
                    await ops.publish(subjects.cancel_subject("another-gateway", request_id), m.encode(forged))
                    await ops.flush()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
        await ops.close()
        return finish, chunks, request_id

    finish, chunks, request_id = asyncio.run(cancel_from_elsewhere())
    assert finish == "length", (finish, chunks)
    # The forged cancel did reach the worker running the request, which refused it.
    refused = [line for name in ("worker-1", "worker-2")
               for line in platform.stack.get(name).log_path.read_text(errors="replace").splitlines()
               if '"cancel_not_owner"' in line and request_id in line]
    assert refused, "the forged cancel never reached the worker: the test proves nothing"


def test_a_gateway_asks_workers_to_resend_its_own_streams_only(platform: Platform) -> None:
    """The gateway's identity may ask any worker to send its own streams' events again (the worker
    holding the stream answers `running`, another `unknown`), but may not ask for another
    gateway's; and a worker asked for another gateway's stream (as a shared identity could) says
    `unknown` and resends nothing."""
    from inferbus.local.stack import GATEWAY_ID

    async def ask() -> tuple[dict[str, str], dict[str, str], m.ResendReply, Connection]:
        gateway = Connection(platform, identity(platform, "gateway"))
        ops = await nats.connect(platform.stack.nats_url)
        own: dict[str, str] = {}
        other: dict[str, str] = {}
        holder = m.ResendReply(state="unknown")
        client = platform.async_client()
        async with gateway as nc, client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "tell me a long story"}], max_tokens=400,
                stream=True) as response:
            request_id = response.headers["x-request-id"]
            # Past the end of the stream: nothing to resend, so the client's stream is untouched.
            question = m.encode(m.ResendRequest(request_id=request_id, attempt=0, from_seq=10**6))
            async for _ in await response.parse():
                if own:
                    continue
                for worker in ("worker-1", "worker-2"):
                    reply = await nc.request(subjects.resend_subject(worker, GATEWAY_ID), question, timeout=5)
                    own[worker] = msgspec.msgpack.decode(reply.data, type=m.ResendReply).state
                    reply = await ops.request(subjects.resend_subject(worker, "another-gateway"), question, timeout=5)
                    other[worker] = msgspec.msgpack.decode(reply.data, type=m.ResendReply).state
                # Asked of every worker at once: only the one running it answers.
                reply = await nc.request(subjects.holder_subject(GATEWAY_ID), question, timeout=5)
                holder = msgspec.msgpack.decode(reply.data, type=m.ResendReply)
                await nc.publish(subjects.resend_subject("worker-1", "another-gateway"), question)
                await nc.publish(subjects.holder_subject("another-gateway"), question)
                await nc.flush()
                await asyncio.sleep(0.2)
        await ops.close()
        return own, other, holder, gateway

    own, other, holder, gateway = asyncio.run(ask())
    assert sorted(own.values()) == ["running", "unknown"], own
    assert holder.state == "running" and own[holder.worker_id] == "running"
    assert other == {"worker-1": "unknown", "worker-2": "unknown"}
    assert gateway.denied("publish", f"{subjects.PREFIX}.resend.worker-1.another-gateway")
    assert gateway.denied("publish", f"{subjects.PREFIX}.holder.another-gateway")


def test_each_identity_has_its_own_inbox_only() -> None:
    """No identity may subscribe to another's replies (JetStream deliveries, request/reply)."""
    for role, user in (("worker", "worker-1"), ("gateway", "gateway"), ("router", "router"), ("billing", "billing"),
                       ("batch", "batch"), ("autoscaler", "autoscaler")):
        allowed = permissions(role, user, "x").subscribe  # type: ignore[arg-type]
        inboxes = [s for s in allowed if s.startswith("_INBOX")]
        assert inboxes == [f"{inbox_prefix(user)}.>"], (role, allowed)
        assert ">" not in allowed and "_INBOX.>" not in allowed
        publish = permissions(role, user, "x").publish  # type: ignore[arg-type]
        assert not [s for s in publish if s.startswith(("$JS.API.STREAM.PURGE", "$JS.API.STREAM.DELETE", "$JS.API.>"))]


def test_the_platform_works_with_its_own_credentials(platform: Platform) -> None:
    reply = platform.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    violations = [line for name in ("gateway", "router", "billing", "batch", "worker-1", "worker-2")
                  for line in platform.stack.get(name).log_path.read_text(errors="replace").splitlines()
                  if "Permissions Violation" in line]
    assert violations == [], violations[:5]


def test_usage_events_decode_as_the_ledger_expects() -> None:
    """Guard for the forged request above: it must be a valid bus message, or the test proves nothing."""
    forged = a_request("inferbus.tok.gateway")
    assert msgspec.msgpack.decode(m.encode(forged), type=m.InferenceRequest) == forged


def test_a_gateway_reports_a_new_retention_and_leaves_the_bucket_to_ops(platform: Platform) -> None:
    """Bucket configuration belongs to ops: when INFERBUS_RESPONSES_RETENTION_S changed, the
    gateway's identity leaves the `responses` bucket as it is and reports the difference (a
    `/ready` problem); the same reopen with the operator's identity applies it."""
    from services.gateway.responses_store import ResponseStore
    from services.gateway.settings import GatewaySettings

    max_bytes = GatewaySettings().responses_max_bytes

    async def reopen() -> tuple[float, float, list[str], float]:
        gateway = Connection(platform, identity(platform, "gateway"))
        async with gateway as nc:
            js = nc.jetstream()
            before = (await js.stream_info(f"KV_{subjects.RESPONSES_BUCKET}")).config.max_age
            drift = (await ResponseStore.open(js, retention_s=before + 60, max_bytes=max_bytes)).drift
            after = (await js.stream_info(f"KV_{subjects.RESPONSES_BUCKET}")).config.max_age
        ops = await nats.connect(platform.stack.nats_url)
        try:
            js = ops.jetstream()
            await ResponseStore.open(js, retention_s=before + 60, max_bytes=max_bytes, update=True)
            by_ops = (await js.stream_info(f"KV_{subjects.RESPONSES_BUCKET}")).config.max_age
            await ResponseStore.open(js, retention_s=before, max_bytes=max_bytes, update=True)
        finally:
            await ops.close()
        return before, after, drift, by_ops

    before, after, drift, by_ops = asyncio.run(reopen())
    assert after == before and by_ops == before + 60
    assert len(drift) == 1 and f"wanted {before + 60}" in drift[0]

def test_a_drifted_ledger_is_a_ready_problem_not_a_crash(platform: Platform) -> None:
    """Ops truncating the ledger's limit (`max_msgs: 5`): the gateway keeps running and its
    `/ready` names the drift until ops restores the stream."""
    import dataclasses

    import httpx

    from inferbus.bus import connection as bus

    from .waiting import wait_for

    def ready() -> dict:  # type: ignore[type-arg]
        return httpx.get(platform.stack.gateway_url + "/ready", timeout=5).json()  # type: ignore[no-any-return]

    async def set_limit(max_msgs: int | None) -> None:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            js = nc.jetstream()
            if max_msgs is None:
                await bus.ensure_streams(js, update=True)
            else:
                usage = (await js.stream_info(subjects.USAGE_STREAM)).config
                await js.update_stream(dataclasses.replace(usage, max_msgs=max_msgs))
        finally:
            await nc.close()

    assert "stream_config_drift" not in ready()["problems"]
    asyncio.run(set_limit(5))
    try:
        def drifted() -> dict | None:  # type: ignore[type-arg]
            body = ready()
            return body if "stream_config_drift" in body["problems"] else None

        body = wait_for(drifted, 15, what="/ready naming the drift")
        assert f"{subjects.USAGE_STREAM}: max_msgs is 5, wanted -1" in body["stream_drift"]
    finally:
        asyncio.run(set_limit(None))
    wait_for(lambda: "stream_config_drift" not in ready()["problems"], 15, what="/ready after ops restored it")
