"""Confused deputies on the bus, against a real nats-server with the shipped authorization
(deploy/k8s/base/nats-auth.conf): a request names its own reply subject, and whoever answers
publishes there with its own rights. A producer must not make the gateway answer into
`$JS.API.STREAM.DELETE.USAGE` (deleting the ledger) or into a KV key (overwriting a record); each
such forgery has a control that must succeed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nkeys
import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, StorageType
from prometheus_client import REGISTRY

from inferbus.bus import connection as bus
from inferbus.bus.auth import DEPLOYMENT_ROLES, inbox_prefix, new_password, password_env
from inferbus.bus.callout import (
    AUTH_PASSWORD_ENV,
    CALLOUT_ACCOUNT,
    ISSUER_ENV,
    Authorizer,
    PodIdentity,
    new_account_seed,
)
from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok
from inferbus.local.servers import nats_server_binary
from inferbus.stores import dispatch_records
from proto import bands, subjects
from proto import messages as m
from services.auth_callout.service import answer_requests
from services.gateway.internal_api import API_CALLS, InternalApi
from services.worker.liveness import LivenessThread

from .waiting import await_for

pytestmark = pytest.mark.e2e

SHIPPED_AUTH = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "base" / "nats-auth.conf"
CALLOUT_AUTH = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "per-pod-identities" / "nats-auth.conf"
RECORD = b'{"id": "batch_1", "tenant": "acme", "status": "in_progress"}'
USAGE_ACME = subjects.usage_subject("acme", subjects.USAGE_FROM_WORKER, "worker-1")


@dataclass
class ShippedBus:
    """A nats-server with one of the shipped authorizations: `static` (one user per role, role-wide
    permissions) or `callout` (per-pod identities: each role's pod gets permissions scoped to its
    pod name from the auth callout)."""

    url: str
    variant: str
    users: dict[str, str]  # role -> NATS user (the pod's name under callout)
    passwords: dict[str, str] = field(default_factory=dict)  # user -> password (static users)
    tokens: dict[str, str] = field(default_factory=dict)  # user -> ServiceAccount token (callout)

    def user(self, role: str) -> str:
        return self.users.get(role, role)

    def env(self, role: str, tmp: Path) -> dict[str, str]:
        """A service's NATS_* environment for `role` (what `bus.connect` reads)."""
        user = self.user(role)
        if user in self.passwords:
            return {"NATS_USER": user, "NATS_PASSWORD": self.passwords[user]}
        token_file = tmp / f"token-{user}"
        token_file.write_text(self.tokens[user])
        return {"NATS_USER": user, "NATS_TOKEN_FILE": str(token_file)}


@contextmanager
def nats_server(tmp: Path, auth: str, env: dict[str, str]) -> Iterator[str]:
    """A nats-server with JetStream and the `auth` config (its URL)."""
    port, monitor = free_port(), free_port()
    (tmp / "nats-auth.conf").write_text(auth)
    (tmp / "nats.conf").write_text(
        f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{monitor}"\njetstream {{ store_dir: "{tmp / "js"}" }}\n'
        'include "nats-auth.conf"\n')
    server = subprocess.Popen([nats_server_binary(), "-c", str(tmp / "nats.conf")], env={**os.environ, **env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not http_ok(f"http://127.0.0.1:{monitor}/healthz"):
            assert time.monotonic() < deadline and server.poll() is None, "nats-server did not start"
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()


@pytest.fixture(scope="module", params=["static", "callout"])
def shipped_bus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShippedBus]:
    """A nats-server with JetStream and the deployment's checked-in authorization: the users and
    permissions of deploy/k8s/base, or the per-pod identities of deploy/k8s/per-pod-identities
    with the callout service answering (a table of tokens standing in for the TokenReview API)."""
    tmp = tmp_path_factory.mktemp(f"shipped-bus-{request.param}")
    if request.param == "static":
        passwords = {user: new_password() for user, _, _ in DEPLOYMENT_ROLES}
        with nats_server(tmp, SHIPPED_AUTH.read_text(), {password_env(u): pw for u, pw in passwords.items()}) as url:
            yield ShippedBus(url, "static", {}, passwords=passwords)
        return
    issuer = nkeys.from_seed(new_account_seed())
    auth_password, ops_password = new_password(), new_password()
    roles = [role for _, role, _ in DEPLOYMENT_ROLES if role != "ops"]
    users = {role: f"{role}-7d9f-x2" for role in roles}
    tokens = {users[role]: new_password() for role in roles}
    pods = {tokens[users[role]]: PodIdentity("inferbus", role, users[role]) for role in roles}
    env = {ISSUER_ENV: issuer.public_key.decode(), AUTH_PASSWORD_ENV: auth_password, password_env("ops"): ops_password}
    with nats_server(tmp, CALLOUT_AUTH.read_text(), env) as url:
        authorizer = Authorizer(issuer=issuer, account=CALLOUT_ACCOUNT, namespace="inferbus", verify_token=pods.get,
                                clock=time.time)
        loop = asyncio.new_event_loop()

        async def serve() -> Client:
            nc = await nats.connect(url, user="auth", password=auth_password)
            await answer_requests(nc, authorizer)  # the callout service's own handler
            return nc

        callout = loop.run_until_complete(serve())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield ShippedBus(url, "callout", users, passwords={"ops": ops_password}, tokens=tokens)
        finally:
            asyncio.run_coroutine_threadsafe(callout.close(), loop).result(5)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)


class As:
    """A connection as one role's identity of the shipped config, recording the server's errors."""

    def __init__(self, bus_: ShippedBus, role: str) -> None:
        self.bus, self.role, self.user = bus_, role, bus_.user(role)
        self.errors: list[str] = []

    async def __aenter__(self) -> Client:
        async def on_error(error: Exception) -> None:
            self.errors.append(str(error))

        credentials: dict[str, Any] = {"user": self.user, "password": self.bus.passwords[self.user]} \
            if self.user in self.bus.passwords else {"token": self.bus.tokens[self.user]}
        self.nc = await nats.connect(self.bus.url, inbox_prefix=inbox_prefix(self.user), error_cb=on_error,
                                     allow_reconnect=False, max_reconnect_attempts=0, **credentials)
        return self.nc

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()


@pytest.fixture
async def ops(shipped_bus: ShippedBus) -> AsyncIterator[Client]:
    """The operator's connection, with the platform's streams and a `batches` record in place."""
    async with As(shipped_bus, "ops") as nc:
        js = nc.jetstream()
        await bus.ensure_streams(js)
        batches = await js.create_key_value(KeyValueConfig(bucket=subjects.BATCHES_BUCKET, history=1,
                                                           storage=StorageType.FILE))
        await batches.put("acme.batch_1", RECORD)
        await js.publish(USAGE_ACME, b"{}")
        yield nc


async def streams_and_record(ops: Client) -> tuple[set[str], bytes | None, int]:
    """The streams that exist, the `batches` record and USAGE's message count."""
    js = ops.jetstream()
    names = {info.config.name for info in await js.streams_info()}  # type: ignore[misc]
    record = (await (await js.key_value(subjects.BATCHES_BUCKET)).get("acme.batch_1")).value
    usage = (await js.stream_info(subjects.USAGE_STREAM)).state.messages if subjects.USAGE_STREAM in names else -1
    return names, record, usage


def counted(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def api_calls() -> float:
    return sum(s.value for metric in API_CALLS.collect() for s in metric.samples if s.name.endswith("_total"))


async def generation(scope: dict[str, Any], receive: Any, send: Any, endpoint: str) -> None:
    """What the gateway's `Generation` answers, as ASGI: a streamed call a chunk then the end, any
    other the OpenAI error for an unknown key. The replies' subjects are the point here."""
    body = json.loads((await receive())["body"] or b"{}")
    if body.get("stream"):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-request-id", b"chatcmpl-x")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\ndata: [DONE]\n\n'})
        return
    await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"error": {"message": "Incorrect API key"}}'})


@pytest.fixture
async def gateway_api(shipped_bus: ShippedBus) -> AsyncIterator[InternalApi]:
    """The gateway's internal API (the OpenAI API over NATS), connected as the gateway."""
    async with As(shipped_bus, "gateway") as nc:
        api = InternalApi(nc, generation, shipped_bus.user("gateway"))
        await api.start()
        await nc.flush()
        yield api
        await api.stop()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_producer_cannot_make_the_gateway_answer_into_jetstream_or_a_bucket(
        ops: Client, shipped_bus: ShippedBus, gateway_api: InternalApi, stream: bool) -> None:
    """A streamed call ends with an empty reply, a valid `$JS.API.STREAM.DELETE.USAGE`; an error
    reply is a valid record for a KV key or a usage subject. The gateway answers none of them, and
    counts each as a security event; the control, a call with the producer's own inbox, is answered."""
    before_streams, before_record, before_usage = await streams_and_record(ops)
    refused_before = counted("inferbus_security_events_total", kind="untrusted_reply")
    calls_before = api_calls()
    body = json.dumps({"model": "m", "stream": stream, "messages": []}).encode()
    forged = [f"$JS.API.STREAM.DELETE.{subjects.USAGE_STREAM}", f"$KV.{subjects.BATCHES_BUCKET}.acme.batch_1",
              USAGE_ACME]
    async with As(shipped_bus, "producer") as producer:
        for reply in forged:
            await producer.publish(subjects.api_subject("chat"), body, reply=reply)
        answer = await producer.request(subjects.api_subject("chat"), body, timeout=5)
        assert answer.headers and answer.headers[m.API_HEADER_STATUS] == ("200" if stream else "401")
    await await_for(lambda: api_calls() + counted("inferbus_security_events_total", kind="untrusted_reply")
                    - calls_before - refused_before >= len(forged) + 1, what="every call handled")
    await ops.flush()
    assert await streams_and_record(ops) == (before_streams, before_record, before_usage)
    assert counted("inferbus_security_events_total", kind="untrusted_reply") - refused_before == len(forged)


@pytest.fixture(scope="module")
def worker_liveness(shipped_bus: ShippedBus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker's liveness thread (its answers to probes), connected as the worker: its id."""
    worker_id = shipped_bus.user("worker")
    with pytest.MonkeyPatch.context() as env:
        for name, value in shipped_bus.env("worker", tmp_path_factory.mktemp("worker")).items():
            env.setenv(name, value)
        liveness = LivenessThread(shipped_bus.url, worker_id, interval_s=0.2, ttl_s=5.0, stall_after_s=30.0,
                                  loop_lag=lambda: 0.0)
        liveness.start()
    try:
        liveness.set_beat(m.Heartbeat(worker_id=worker_id, model="m", engine_url="http://127.0.0.1:1",
                                      started=time.time(), ts=time.time()))
        yield worker_id
    finally:
        liveness.stop()


async def test_a_worker_answers_no_liveness_probe_into_the_ledger(
        ops: Client, shipped_bus: ShippedBus, worker_liveness: str) -> None:
    """The worker's identity may publish usage; a gateway's probe naming a usage subject as its
    reply would have the worker write its answer into the ledger. Control: a probe with the
    gateway's own inbox is answered."""
    _, _, usage_before = await streams_and_record(ops)
    refused_before = counted("inferbus_security_events_total", kind="untrusted_reply")
    probe = m.encode(m.LivenessProbe(worker_id=worker_liveness))
    async with As(shipped_bus, "gateway") as gateway:
        await gateway.publish(subjects.liveness_subject(worker_liveness), probe, reply=USAGE_ACME)
        answer = await await_for(lambda: gateway.request(subjects.liveness_subject(worker_liveness), probe, timeout=1),
                                 ignore=(nats.errors.TimeoutError, nats.errors.NoRespondersError))
        assert m.decoder(m.LivenessReply).decode(answer.data).worker_id == worker_liveness
    await await_for(lambda: counted("inferbus_security_events_total", kind="untrusted_reply") > refused_before,
                    what="the forged probe refused")
    assert (await streams_and_record(ops))[2] == usage_before


async def test_nats_deny_rules_do_not_restrict_responses(tmp_path: Path) -> None:
    """What nats-server does (measured, docs/security.md): `allow_responses` lets a user answer on
    any reply subject of a request it received, its publish deny list notwithstanding; the deny
    list still refuses a direct publish. So the reply subject is checked by the responder."""
    auth = """authorization { users = [
      { user: asker, password: a, permissions: { publish: ["ask"], subscribe: ["_INBOX.asker.>"] } }
      { user: watcher, password: w, permissions: { subscribe: ["$KV.>"] } }
      { user: answerer, password: b, permissions: { publish: { deny: ["$KV.>"] }, subscribe: ["ask"],
                                                    allow_responses: true } }
    ] }"""
    with nats_server(tmp_path, auth, {}) as url:
        errors: list[str] = []

        async def on_error(error: Exception) -> None:
            errors.append(str(error))

        answerer = await nats.connect(url, user="answerer", password="b", error_cb=on_error)
        watcher = await nats.connect(url, user="watcher", password="w")
        asker = await nats.connect(url, user="asker", password="a", inbox_prefix="_INBOX.asker")
        seen: list[str] = []

        async def answer(msg: Any) -> None:
            await msg.respond(b"answer")

        async def watch(msg: Any) -> None:
            seen.append(msg.subject)

        await answerer.subscribe("ask", cb=answer)
        await watcher.subscribe("$KV.>", cb=watch)
        await answerer.flush()
        await watcher.flush()
        await answerer.publish("$KV.direct", b"x")  # refused: the deny list
        await asker.publish("ask", b"", reply="$KV.bucket.key")  # answered: the response permission
        await await_for(lambda: seen, what="the answer on the KV subject")
        assert seen == ["$KV.bucket.key"]
        assert any("permissions violation" in e.lower() and "$kv.direct" in e.lower() for e in errors)
        for nc in (answerer, watcher, asker):
            await nc.close()


# ---- the adversarial suite: every identity, every forgery, each with a control ------------------

SERVICE_IDENTITIES = [user for user, role, _ in DEPLOYMENT_ROLES if role != "ops"]
# Identities with some `$JS.API` right (every service; a producer has none).
WITH_JETSTREAM = [user for user in SERVICE_IDENTITIES if user != "producer"]
FORGED_REPLIES = {
    "jetstream-api": f"$JS.API.STREAM.DELETE.{subjects.USAGE_STREAM}",
    "kv-key": f"$KV.{subjects.BATCHES_BUCKET}.acme.batch_1",
    "data-subject": USAGE_ACME,
}


async def refused(conn: As, verb: str, subject: str) -> bool:
    """Whether the server reported a permissions violation for `verb` on `subject` to `conn`."""
    def seen() -> bool:
        return any("permissions violation" in e.lower() and verb in e.lower() and subject.lower() in e.lower()
                   for e in conn.errors)

    await await_for(seen, 5, what=f"the server refusing {verb} {subject}")
    return True


async def control(conn: As, nc: Client) -> None:
    """What the identity may do, done: a JetStream call answered on its own inbox (a service), or
    an internal API call answered by the gateway (a producer)."""
    if conn.role == "producer":
        answer = await nc.request(subjects.api_subject("chat"), b'{"messages": []}', timeout=5)
        assert answer.headers and answer.headers[m.API_HEADER_STATUS] == "401"
    else:
        answer = await nc.request(f"$JS.API.STREAM.INFO.{subjects.REQUESTS_STREAM}", b"", timeout=5)
        assert json.loads(answer.data)["config"]["name"] == subjects.REQUESTS_STREAM


def test_every_identity_is_in_the_suite() -> None:
    """A new identity in the shipped config must be added to the suite's forgeries."""
    assert sorted(SERVICE_IDENTITIES) == ["autoscaler", "batch", "billing", "gateway", "producer", "router", "worker"]


async def test_no_credentials_no_connection(shipped_bus: ShippedBus) -> None:
    with pytest.raises(Exception) as refused_connect:  # noqa: B017 (nats-py raises several kinds)
        await nats.connect(shipped_bus.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    assert "authorization" in repr(refused_connect.value).lower() or "no servers" in repr(refused_connect.value).lower()
    async with As(shipped_bus, "ops"):  # control: the operator's credentials connect
        pass


@pytest.mark.parametrize("user", SERVICE_IDENTITIES)
@pytest.mark.parametrize("action", ["UPDATE", "DELETE", "PURGE"])
@pytest.mark.parametrize("stream", [subjects.USAGE_STREAM, subjects.REQUESTS_STREAM, f"KV_{subjects.BATCHES_BUCKET}",
                                    f"KV_{subjects.RESPONSES_BUCKET}"])
async def test_no_service_identity_reconfigures_purges_or_deletes_a_stream(
        ops: Client, shipped_bus: ShippedBus, user: str, action: str, stream: str) -> None:
    """With the config that truncated the ledger (`max_msgs: 5`) for an update."""
    await ops.jetstream().create_key_value(KeyValueConfig(bucket=subjects.RESPONSES_BUCKET, history=1))
    before = await streams_and_record(ops)
    config = (await ops.jetstream().stream_info(stream)).config.as_dict()
    body = json.dumps({**config, "max_msgs": 5}).encode() if action == "UPDATE" else b""
    subject = f"$JS.API.STREAM.{action}.{stream}"
    conn = As(shipped_bus, user)
    async with conn as nc:
        await nc.publish(subject, body, reply=nc.new_inbox())
        assert await refused(conn, "publish", subject)
        if user != "producer":
            await control(conn, nc)
    assert await streams_and_record(ops) == before
    assert (await ops.jetstream().stream_info(stream)).config.max_msgs == -1


@pytest.mark.parametrize("user", SERVICE_IDENTITIES)
@pytest.mark.parametrize("target", sorted(FORGED_REPLIES))
async def test_no_identity_makes_the_gateway_answer_outside_an_inbox(
        ops: Client, shipped_bus: ShippedBus, gateway_api: InternalApi, user: str, target: str) -> None:
    """A producer's forged call is refused by the gateway (a security event); any other identity
    may not call the internal API at all (refused by the server)."""
    before = await streams_and_record(ops)
    events_before = counted("inferbus_security_events_total", kind="untrusted_reply")
    body = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    conn = As(shipped_bus, user)
    async with conn as nc:
        await nc.publish(subjects.api_subject("chat"), body, reply=FORGED_REPLIES[target])
        if user == "producer":
            await await_for(lambda: counted("inferbus_security_events_total", kind="untrusted_reply") > events_before,
                            what="the gateway refusing the reply subject")
        else:
            assert await refused(conn, "publish", subjects.api_subject("chat"))
        await control(conn, nc)
    await ops.flush()
    assert await streams_and_record(ops) == before


@pytest.mark.parametrize("user", ["gateway", "worker"])  # the identities that may probe a worker
@pytest.mark.parametrize("target", sorted(FORGED_REPLIES))
async def test_no_identity_makes_a_worker_answer_outside_an_inbox(
        ops: Client, shipped_bus: ShippedBus, worker_liveness: str, user: str, target: str) -> None:
    before = await streams_and_record(ops)
    events_before = counted("inferbus_security_events_total", kind="untrusted_reply")
    probe = m.encode(m.LivenessProbe(worker_id=worker_liveness))
    async with As(shipped_bus, user) as nc:
        await nc.publish(subjects.liveness_subject(worker_liveness), probe, reply=FORGED_REPLIES[target])
        answer = await nc.request(subjects.liveness_subject(worker_liveness), probe, timeout=5)  # control
        assert m.decoder(m.LivenessReply).decode(answer.data).worker_id == worker_liveness
    await await_for(lambda: counted("inferbus_security_events_total", kind="untrusted_reply") > events_before,
                    what="the worker refusing the reply subject")
    assert await streams_and_record(ops) == before


# Where a JetStream answer would do harm: FORGED_REPLIES, and a queued request and a batch result
# (the other subjects the platform's streams store).
JETSTREAM_FORGED_REPLIES = {
    **FORGED_REPLIES,
    "queued-request": subjects.request_subject("interactive", "m", subjects.ANY_TARGET,
                                               subjects.token_subject("batch-main")),
    "batch-result": subjects.batch_result_subject("batch_1", subjects.RESULT_FROM_OWNER, "batch-main"),
}


async def stored(ops: Client) -> tuple[tuple[set[str], bytes | None, int], int, int]:
    """`streams_and_record`, with the messages in REQUESTS and BATCH_RESULTS."""
    js = ops.jetstream()
    return (await streams_and_record(ops), (await js.stream_info(subjects.REQUESTS_STREAM)).state.messages,
            (await js.stream_info(subjects.BATCH_RESULTS_STREAM)).state.messages)


@pytest.mark.parametrize("user", SERVICE_IDENTITIES)
@pytest.mark.parametrize("target", sorted(JETSTREAM_FORGED_REPLIES))
async def test_jetstream_answers_no_identitys_api_call_outside_an_inbox(
        ops: Client, shipped_bus: ShippedBus, gateway_api: InternalApi, user: str, target: str) -> None:
    """`$JS.API.STREAM.INFO` (an API call every service identity may make; `$JS.API.INFO` for a
    producer, which has none: refused by the server) with a forged reply subject. JetStream is in
    an account of its own: its answer goes back through the services' account's import, is
    delivered there on the subject named (seen by the operator), and is stored by no stream or
    bucket. Control: the same call on the identity's own inbox is answered."""
    forged = JETSTREAM_FORGED_REPLIES[target]
    before = await stored(ops)
    delivered = await ops.subscribe(forged)
    await ops.flush()
    subject = f"$JS.API.STREAM.INFO.{subjects.REQUESTS_STREAM}" if user in WITH_JETSTREAM else "$JS.API.INFO"
    conn = As(shipped_bus, user)
    async with conn as nc:
        await nc.publish(subject, b"", reply=forged)
        if user in WITH_JETSTREAM:  # the forged call was answered: where to is the point
            assert b"stream_info_response" in (await delivered.next_msg(timeout=5)).data
        else:
            assert await refused(conn, "publish", subject)
        await control(conn, nc)
    await delivered.unsubscribe()
    await ops.flush()
    assert await stored(ops) == before


async def test_no_jetstream_acknowledgement_or_delivery_lands_in_a_bucket(ops: Client, shipped_bus: ShippedBus) -> None:
    """JetStream's other answers: a publish's acknowledgement goes to the publish's reply subject,
    a push consumer's messages to its deliver subject. A worker publishes its own usage with a KV
    key as the reply, and creates a push consumer on `workers` (which it may read) delivering into
    a KV key and into the ledger: nothing is stored there. Controls: the usage is stored, and the
    same consumer delivering to the worker's own inbox delivers."""
    async with As(shipped_bus, "worker") as worker:
        worker_id = shipped_bus.user("worker")
        workers = await bus.workers_bucket(ops.jetstream(), heartbeat_ttl_s=60.0)
        await workers.put(subjects.worker_key(worker_id), b"{}")
        before = await stored(ops)
        usage = subjects.usage_subject("acme", subjects.USAGE_FROM_WORKER, worker_id)
        await worker.publish(usage, b"{}", reply=f"$KV.{subjects.BATCHES_BUCKET}.acme.batch_1")
        stream = f"KV_{subjects.WORKERS_BUCKET}"
        for deliver in (f"$KV.{subjects.BATCHES_BUCKET}.acme.batch_1", USAGE_ACME, worker.new_inbox()):
            control = await worker.subscribe(deliver) if deliver.startswith("_INBOX.") else None
            config = {"deliver_subject": deliver, "ack_policy": "none", "deliver_policy": "all"}
            answer = await worker.request(f"$JS.API.CONSUMER.CREATE.{stream}",
                                          json.dumps({"stream_name": stream, "config": config}).encode(), timeout=5)
            assert "error" not in json.loads(answer.data), answer.data
            if control is not None:  # the deliveries do reach an inbox
                assert (await control.next_msg(timeout=5)).subject.startswith(f"$KV.{subjects.WORKERS_BUCKET}.")
        await worker.flush()
        await ops.flush()
        (names, record, usage_count), queued_, results = before
        await await_for(lambda: _usage_count(ops, usage_count + 1), what="the worker's own usage stored")
        assert await stored(ops) == ((names, record, usage_count + 1), queued_, results)


async def _usage_count(ops: Client, wanted: int) -> bool:
    return (await ops.jetstream().stream_info(subjects.USAGE_STREAM)).state.messages == wanted


async def test_jetstream_answers_the_services_account_not_its_own(ops: Client, shipped_bus: ShippedBus) -> None:
    """The model (docs/security.md): JetStream's answer to a forged reply subject is delivered in
    the services' account on that subject, to whoever subscribes to it there (here the operator,
    on the KV key), and written nowhere; the same key put through the import is stored."""
    key = f"$KV.{subjects.BATCHES_BUCKET}.acme.batch_1"
    answers = await ops.subscribe(key)
    await ops.flush()
    async with As(shipped_bus, "gateway") as gateway:
        await gateway.publish("$JS.API.INFO", b"", reply=key)
        assert b"account_info_response" in (await answers.next_msg(timeout=5)).data
        await ops.flush()
        assert (await streams_and_record(ops))[1] == RECORD
        put = await gateway.request(key, b"put", timeout=5)  # control: a KV put through the import
        assert json.loads(put.data)["stream"] == f"KV_{subjects.BATCHES_BUCKET}"
    kv = await ops.jetstream().key_value(subjects.BATCHES_BUCKET)
    assert (await kv.get("acme.batch_1")).value == b"put"
    await kv.put("acme.batch_1", RECORD)
    await answers.unsubscribe()


async def test_drift_is_reported_not_fatal_and_a_description_is_no_drift(
        ops: Client, shipped_bus: ShippedBus, monkeypatch: pytest.MonkeyPatch) -> None:
    """After ops changes a platform stream, a service's `ensure_streams` (which no longer tries an
    update its identity may not make) reports what matters and carries on; ops restores it."""
    js = ops.jetstream()
    usage = (await js.stream_info(subjects.USAGE_STREAM)).config
    try:
        await js.update_stream(dataclasses.replace(usage, description="edited by ops"))
        async with As(shipped_bus, "worker") as worker:
            assert await bus.ensure_streams(worker.jetstream()) == []
            await js.update_stream(dataclasses.replace(usage, max_msgs=5))
            drift = await bus.ensure_streams(worker.jetstream())
        assert drift == [f"{subjects.USAGE_STREAM}: max_msgs is 5, wanted -1"]
        assert counted("inferbus_stream_config_drift", stream=subjects.USAGE_STREAM) == 1
        assert (await js.stream_info(subjects.USAGE_STREAM)).config.max_msgs == 5  # the worker changed nothing
    finally:
        assert await bus.ensure_streams(js, update=True) == []  # ops's own identity restores it
    assert (await js.stream_info(subjects.USAGE_STREAM)).config.max_msgs == -1
    assert counted("inferbus_stream_config_drift", stream=subjects.USAGE_STREAM) == 0


async def test_a_missing_ledger_is_reported(ops: Client, shipped_bus: ShippedBus) -> None:
    """What a gateway's `/ready` checks with the gateway's identity: a deleted ledger is named
    (and created again by the next `ensure_streams`)."""
    async with As(shipped_bus, "gateway") as gateway:
        assert await bus.check_streams(gateway.jetstream()) == []
        await ops.jetstream().delete_stream(subjects.USAGE_STREAM)
        assert await bus.check_streams(gateway.jetstream()) == [f"{subjects.USAGE_STREAM}: missing"]
        assert await bus.ensure_streams(gateway.jetstream()) == []
        assert await bus.check_streams(gateway.jetstream()) == []


# ---- work creation: only the batch service creates batch lines; the router creates no batch work ----

BATCH_OWNER = subjects.token_subject("batch-main")  # the shipped batch service's reply subject (its scope)
# Identities that must not queue a batch-band line (the gateway queues requests of its own clients).
NO_BATCH_LINES = ["router", "billing", "autoscaler", "producer", "worker"]


async def queued(ops: Client) -> int:
    return (await ops.jetstream().stream_info(subjects.REQUESTS_STREAM)).state.messages


@pytest.mark.parametrize("user", NO_BATCH_LINES)
async def test_only_the_batch_service_creates_batch_lines(ops: Client, shipped_bus: ShippedBus, user: str) -> None:
    """A batch-band line for any owner, billed to another tenant: refused by the server (a worker
    hands a preempted line back to its batch service, which queues the next attempt). Control:
    the batch service's own line is stored."""
    forged = m.encode(m.InferenceRequest(request_id="forged", tenant="acme", model="m", prompt="x",
                                         sampling=m.SamplingParams(max_new_tokens=8),
                                         reply_to=BATCH_OWNER, deadline=time.time() + 60, created=time.time()))
    before = await queued(ops)
    for owner in (BATCH_OWNER, subjects.token_subject(shipped_bus.user("gateway"))):
        subject = subjects.request_subject("batch", "m", subjects.ANY_TARGET, owner)
        conn = As(shipped_bus, user)
        async with conn as nc:
            await nc.publish(subject, forged)
            assert await refused(conn, "publish", subject)
    await ops.flush()
    assert await queued(ops) == before
    async with As(shipped_bus, "batch") as batch:  # control: the batch service's line
        subject = subjects.request_subject("batch", "m", subjects.ANY_TARGET, BATCH_OWNER)
        await batch.jetstream().publish(subject, forged)
    assert await queued(ops) == before + 1


async def test_the_router_moves_interactive_work_only(ops: Client, shipped_bus: ShippedBus) -> None:
    """The router's one publishing right on the queue is moving a dead worker's queued requests
    (interactive bands: workers have no queue of their own for batch lines) to the shared queue."""
    before = await queued(ops)
    owner = subjects.token_subject(shipped_bus.user("gateway"))
    async with As(shipped_bus, "router") as router:  # control: recovery's publish is stored
        for band in bands.INTERACTIVE:
            await router.jetstream().publish(subjects.request_subject(band, "m", subjects.ANY_TARGET, owner), b"{}")
    assert await queued(ops) == before + len(bands.INTERACTIVE)


async def only_its_own_is_stored(ops: Client, shipped_bus: ShippedBus, user: str, forged: list[str],
                                 own: str | None, snapshot: Callable[[Client], Awaitable[tuple[Any, ...]]]) -> None:
    """`user` publishes each `forged` subject: the server refuses each and `snapshot` (whose last
    item counts the stored messages) is unchanged; then its `own` subject (None: the control on its
    inbox) is stored, one message more."""
    before = await snapshot(ops)
    conn = As(shipped_bus, user)
    async with conn as nc:
        for subject in forged:
            await nc.publish(subject, b"{}")
            assert await refused(conn, "publish", subject)
        await ops.flush()
        assert await snapshot(ops) == before
        if own is None:
            await control(conn, nc)
        else:
            await nc.jetstream().publish(own, b"{}")
    *rest, count = before
    assert await snapshot(ops) == (*rest, count + (own is not None))


# ---- usage: each identity reports usage only as itself ----------------------------------------

@pytest.mark.parametrize("user", SERVICE_IDENTITIES)
async def test_usage_is_reported_only_as_oneself(ops: Client, shipped_bus: ShippedBus, gateway_api: InternalApi,
                                                 user: str) -> None:
    """A usage subject names its reporter (`inferbus.usage.<tenant>.<w | o>.<sender>`): a worker
    reports as a worker, a gateway as a request's owner, nobody else at all; with per-pod
    identities each only under its own pod name (role-wide, any replica's name: billing then
    judges the event by its names and the attempt's claim). Refused by the server, the ledger
    unchanged; control: the identity's own report is stored."""
    worker, gateway = shipped_bus.user("worker"), shipped_bus.user("gateway")
    w, o = subjects.USAGE_FROM_WORKER, subjects.USAGE_FROM_OWNER
    own = {"worker": subjects.usage_subject("acme", w, worker),
           "gateway": subjects.usage_subject("acme", o, gateway)}.get(user)
    forged = [s for s in (subjects.usage_subject("acme", w, worker), subjects.usage_subject("acme", o, gateway))
              if s != own]
    if shipped_bus.variant == "callout" and user in ("worker", "gateway"):
        forged.append(subjects.usage_subject("acme", w if user == "worker" else o, f"{user}-other-pod"))
    await only_its_own_is_stored(ops, shipped_bus, user, forged, own, streams_and_record)


@pytest.mark.parametrize("user", SERVICE_IDENTITIES)
async def test_stream_events_are_published_only_as_oneself(ops: Client, shipped_bus: ShippedBus,
                                                           gateway_api: InternalApi, user: str) -> None:
    """A stream event's subject ends with its publisher (`inferbus.tok.<gateway>.<worker>`): only
    workers publish events; with per-pod identities each only under its own pod name (role-wide,
    any worker's). Refused by the server, nothing delivered; control: a worker's own event is."""
    gateway, worker = shipped_bus.user("gateway"), shipped_bus.user("worker")
    reply_to = subjects.token_subject(gateway)
    own = subjects.event_subject(reply_to, worker) if user == "worker" else None
    forged = [subjects.event_subject(reply_to, "worker-other-pod")]
    if user == "worker" and shipped_bus.variant == "static":
        forged = []  # role-wide: every worker replica is the same user
    if user != "worker":
        forged.append(subjects.event_subject(reply_to, worker))
    seen: list[str] = []

    async def record(msg: Any) -> None:
        seen.append(msg.subject)

    await ops.subscribe(subjects.event_filter(gateway), cb=record)
    await ops.flush()
    conn = As(shipped_bus, user)
    async with conn as nc:
        for subject in forged:
            await nc.publish(subject, b"x")
            assert await refused(conn, "publish", subject)
        if own is None:
            await control(conn, nc)
        else:
            await nc.publish(own, b"x")
            await nc.flush()
    await ops.flush()
    await await_for(lambda: seen == ([own] if own else []), 5, what="only the identity's own event delivered")


@pytest.mark.parametrize("user", SERVICE_IDENTITIES)
async def test_batch_results_are_published_only_as_oneself(ops: Client, shipped_bus: ShippedBus,
                                                           gateway_api: InternalApi, user: str) -> None:
    """A batch result's subject names its publisher (`inferbus.batchres.<batch>.<w | o>.<sender>`):
    a worker publishes results as a worker, the batch service records them as itself, nobody else
    publishes any; with per-pod identities a worker only under its own pod name (role-wide, any
    worker's: the batch service then judges a result by the names and the attempt's holder).
    Refused by the server, BATCH_RESULTS unchanged; control: the identity's own result is stored."""
    worker = shipped_bus.user("worker")
    w, o = subjects.RESULT_FROM_WORKER, subjects.RESULT_FROM_OWNER
    as_worker, as_batch = (subjects.batch_result_subject("batch_1", w, worker),
                           subjects.batch_result_subject("batch_1", o, "batch-main"))
    own = {"worker": as_worker, "batch": as_batch}.get(user)
    forged = [s for s in (as_worker, as_batch, subjects.batch_result_subject("batch_1", o, worker)) if s != own]
    if shipped_bus.variant == "callout" and user == "worker":
        forged.append(subjects.batch_result_subject("batch_1", w, "worker-other-pod"))
    await only_its_own_is_stored(ops, shipped_bus, user, forged, own, stored)


# ---- dispatch records: only who queues a request says for whom -----------------------------------

DISPATCH_WRITERS = ["gateway", "batch"]


@pytest.mark.parametrize("user", SERVICE_IDENTITIES)
async def test_only_gateways_and_the_batch_service_write_dispatch_records(
        ops: Client, shipped_bus: ShippedBus, gateway_api: InternalApi, user: str) -> None:
    """Billing takes a worker's usage only for a request whose dispatch record names its tenant
    (services/billing/attribution.py): a worker (or anyone but who queues requests) writing one
    would bill any request id it likes. Refused by the server, the bucket unchanged; controls: a
    gateway's and the batch service's records are stored, and billing and workers read them."""
    dispatches = await bus.dispatches_bucket(ops.jetstream())
    request_id = f"chatcmpl-{user}-{shipped_bus.variant}"
    record = m.encode(m.Dispatch(request_id=request_id, tenant="acme", reply_to="inferbus.tok.x", created=0.0))
    subject = subjects.dispatch_put_subject(request_id)
    conn = As(shipped_bus, user)
    async with conn as nc:
        if user in DISPATCH_WRITERS:
            answer = await nc.request(subject, record, timeout=5)
            assert json.loads(answer.data)["stream"] == f"KV_{subjects.DISPATCHES_BUCKET}"
            assert (await dispatches.get(subjects.dispatch_key(request_id))).value == record
        else:
            await nc.publish(subject, record)
            assert await refused(conn, "publish", subject)
            await ops.flush()
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await dispatches.get(subjects.dispatch_key(request_id))
            await control(conn, nc)
    if user in ("billing", "worker"):  # what billing and workers do with them: read one
        await dispatches.put(subjects.dispatch_key(request_id), record)
        async with As(shipped_bus, user) as reader:
            assert await dispatch_records.lookup(reader.jetstream(), request_id) == m.Dispatch(
                request_id=request_id, tenant="acme", reply_to="inferbus.tok.x", created=0.0)
            kv = await reader.jetstream().key_value(subjects.DISPATCHES_BUCKET)
            assert (await kv.get(subjects.dispatch_key(request_id))).value == record
            assert await dispatch_records.lookup(reader.jetstream(), "never-dispatched") is None
