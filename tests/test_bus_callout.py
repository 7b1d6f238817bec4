"""Per-pod identities through NATS auth callout, against a real nats-server: a pod that presents
its ServiceAccount token gets its role's permissions scoped to its own pod name (a gateway pod
reads its own token subject only and publishes requests that stream back to itself only); an
invalid token, a pod of another namespace or of an unknown ServiceAccount is refused. The token
verifier is the deployment's TokenReview; here a table of tokens stands in for the Kubernetes API."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import nkeys
import pytest

from inferbus.bus.auth import inbox_prefix, new_password, password_env
from inferbus.bus.callout import (
    AUTH_PASSWORD_ENV,
    CALLOUT_ACCOUNT,
    ISSUER_ENV,
    Authorizer,
    CalloutError,
    PodIdentity,
    decode_jwt,
    deployment_callout_config,
    encode_jwt,
    new_account_seed,
)
from inferbus.bus.connection import BusSettings
from inferbus.local.ports import free_port
from inferbus.local.probes import http_ok
from inferbus.local.servers import nats_server_binary
from proto import subjects
from services.auth_callout.service import answer_requests

pytestmark = pytest.mark.e2e

CALLOUT_CONF = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "per-pod-identities" / "nats-auth.conf"

TOKENS = {
    "token-gw-a": PodIdentity("inferbus", "gateway", "gateway-a"),
    "token-gw-b": PodIdentity("inferbus", "gateway", "gateway-b"),
    "token-other-ns": PodIdentity("default", "gateway", "gateway-x"),
    "token-unknown-sa": PodIdentity("inferbus", "default", "someone"),
    "token-batch": PodIdentity("inferbus", "batch", "batch-7d9f-x2"),
}


@pytest.fixture
def callout_nats(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(URL of a nats-server with the deployment's callout config, the ops password)."""
    issuer = nkeys.from_seed(new_account_seed())
    auth_password, ops_password = new_password(), new_password()
    port, monitor = free_port(), free_port()
    shutil.copy(CALLOUT_CONF, tmp_path / "nats-auth.conf")
    (tmp_path / "nats.conf").write_text(
        f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{monitor}"\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        'include "nats-auth.conf"\n')
    env = {**os.environ, ISSUER_ENV: issuer.public_key.decode(), AUTH_PASSWORD_ENV: auth_password,
           password_env("ops"): ops_password}
    server = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "nats.conf")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    authorizer = Authorizer(issuer=issuer, account=CALLOUT_ACCOUNT, namespace="inferbus", verify_token=TOKENS.get,
                            clock=time.time)
    loop = asyncio.new_event_loop()

    async def serve() -> nats.NATS:
        nc = await nats.connect(url, user="auth", password=auth_password)
        await answer_requests(nc, authorizer)  # the service's own handler
        return nc

    try:
        deadline = time.monotonic() + 10
        while not http_ok(f"http://127.0.0.1:{monitor}/healthz"):
            assert time.monotonic() < deadline and server.poll() is None, "nats-server did not start"
            time.sleep(0.05)
        callout = loop.run_until_complete(serve())
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        yield url, ops_password
        asyncio.run_coroutine_threadsafe(callout.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    finally:
        server.terminate()
        server.wait()


async def _connect(url: str, token: str, user: str, errors: list[str]) -> nats.NATS:
    async def on_error(error: Exception) -> None:
        errors.append(str(error))

    return await nats.connect(url, token=token, inbox_prefix=inbox_prefix(user), error_cb=on_error,
                              allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)


def _denied(errors: list[str], verb: str, subject: str) -> bool:
    return any(
        "permissions violation" in e.lower() and verb in e.lower() and subject.lower() in e.lower() for e in errors
    )


def test_a_gateway_pod_gets_its_own_subjects_only(callout_nats: tuple[str, str]) -> None:
    url, ops_password = callout_nats
    own, other = subjects.token_subject("gateway-a"), subjects.token_subject("gateway-b")
    own_events, other_events = subjects.event_filter("gateway-a"), subjects.event_filter("gateway-b")

    async def run() -> tuple[list[str], list[str]]:
        seen: list[str] = []
        ops = await nats.connect(url, user="ops", password=ops_password)

        async def record(msg) -> None:  # type: ignore[no-untyped-def]
            seen.append(msg.subject)

        await ops.subscribe("inferbus.req.>", cb=record)
        await ops.flush()
        errors: list[str] = []
        gateway = await _connect(url, "token-gw-a", "gateway-a", errors)
        await gateway.subscribe(own_events)  # allowed
        await gateway.subscribe(other_events)  # denied: gateway-b's stream
        await gateway.publish(subjects.request_subject("standard", "m", subjects.ANY_TARGET, own), b"x")  # allowed
        await gateway.publish(subjects.request_subject("standard", "m", subjects.ANY_TARGET, other), b"x")  # denied
        await gateway.flush()
        await asyncio.sleep(0.5)
        await gateway.close()
        await ops.close()
        return seen, errors

    seen, errors = asyncio.run(run())
    assert seen == [subjects.request_subject("standard", "m", subjects.ANY_TARGET, own)], seen
    assert _denied(errors, "subscription", other_events), errors
    assert _denied(errors, "publish", subjects.request_subject("standard", "m", subjects.ANY_TARGET, other)), errors
    assert not any(own in e for e in errors), errors  # its own subjects were allowed


@pytest.mark.parametrize("token", ["not-a-token", "token-other-ns", "token-unknown-sa", ""])
def test_pods_without_a_valid_token_of_a_known_service_account_are_refused(callout_nats: tuple[str, str],
                                                                           token: str) -> None:
    url, _ = callout_nats

    async def run() -> None:
        with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
            await _connect(url, token or "x", "someone", []) if token else await nats.connect(
                url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)

    asyncio.run(run())


def test_a_service_connects_with_its_token_file(callout_nats: tuple[str, str], tmp_path: Path) -> None:
    """BusSettings reads the token from NATS_TOKEN_FILE at every (re)connect: kubelet rotates it."""
    url, _ = callout_nats
    token_file = tmp_path / "token"
    token_file.write_text("token-gw-b\n")
    settings = BusSettings(user="gateway-b", token_file=str(token_file))

    async def run() -> bool:
        nc = await nats.connect(url, allow_reconnect=False, **settings.options(url))  # type: ignore[arg-type]
        reply = await nc.request("$JS.API.INFO", b"", timeout=5)  # a right every service has
        await nc.close()
        return b"memory" in reply.data

    assert asyncio.run(run())


def test_requests_must_be_signed_by_a_server() -> None:
    account = nkeys.from_seed(new_account_seed())
    forged = encode_jwt({"iss": account.public_key.decode(), "nats": {}}, account)
    with pytest.raises(CalloutError):
        decode_jwt(forged)  # an account key is not a server's
    with pytest.raises(CalloutError):
        decode_jwt("a.b.c")


def test_the_checked_in_callout_config_is_the_codes() -> None:
    assert CALLOUT_CONF.read_text() == deployment_callout_config(), (
        "regenerate: inferbus bus-config --callout > deploy/k8s/per-pod-identities/nats-auth.conf")


def test_the_batch_service_keeps_its_stable_id_as_its_scope() -> None:
    """One batch service per platform: its scope is its service id, not its (changing) pod name."""
    authorizer = Authorizer(issuer=nkeys.from_seed(new_account_seed()), account=CALLOUT_ACCOUNT, namespace="inferbus",
                            verify_token=TOKENS.get, clock=time.time)
    user, granted = authorizer.decide({"auth_token": "token-batch"})
    assert user == "batch-7d9f-x2"
    assert subjects.event_filter("batch-main") in granted.subscribe
    assert f"{inbox_prefix('batch-7d9f-x2')}.>" in granted.subscribe
    gateway_user, gateway = authorizer.decide({"auth_token": "token-gw-a"})
    assert gateway_user == "gateway-a" and subjects.event_filter("gateway-a") in gateway.subscribe
    with pytest.raises(CalloutError):
        authorizer.decide({"auth_token": "token-gw-a", "user": "gateway-b"})  # a name that is not its own
