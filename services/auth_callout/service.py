"""The auth callout service: answers nats-server's authorization requests (`$SYS.REQ.USER.AUTH`)
with `inferbus.bus.callout.Authorizer`, verifying pods' ServiceAccount tokens with the
Kubernetes TokenReview API. A thin shell: the decision and the JWTs are in inferbus/bus/callout.py."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import nkeys
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from inferbus.bus import connection as bus
from inferbus.bus.callout import AUTH_SUBJECT, Authorizer, CalloutError, PodIdentity
from inferbus.runtime import logs

from .settings import AuthCalloutSettings

log = logs.get(__name__)
CALLOUT_QUEUE = "auth-callout"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"  # set by the API server for bound (projected) tokens


def token_review_verifier(audience: str):  # type: ignore[no-untyped-def]
    """A verifier asking the Kubernetes API (TokenReview) about a token, from inside the cluster."""
    from kubernetes import client, config

    config.load_incluster_config()
    api = client.AuthenticationV1Api()

    def verify(token: str) -> PodIdentity | None:
        review = api.create_token_review(client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=[audience])))
        status = review.status
        if not status or not status.authenticated or not status.user:
            return None
        parts = (status.user.username or "").split(":")  # system:serviceaccount:<namespace>:<name>
        pods = (status.user.extra or {}).get(POD_NAME_EXTRA) or []
        if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or len(pods) != 1:
            return None  # not a ServiceAccount token bound to a pod
        return PodIdentity(namespace=parts[2], service_account=parts[3], pod=pods[0])

    return verify


def static_tokens_verifier(path: str):  # type: ignore[no-untyped-def]
    """A verifier from a file of static tokens (read once): for platforms without Kubernetes."""
    table = {token: PodIdentity(**who) for token, who in json.loads(Path(path).read_text()).items()}
    return table.get


async def answer_requests(nc: Client, authorizer: Authorizer) -> Subscription:
    """Answer every authorization request the server sends (its `auth_users` may subscribe)."""

    async def answer(msg: Msg) -> None:
        try:
            # The verifier may make a blocking HTTP call (TokenReview): off the event loop.
            response = await asyncio.to_thread(authorizer.respond, msg.data.decode())
        except CalloutError as error:  # not a server's request: no answer (the server times out)
            log.warning("callout_bad_request", error=str(error))
            return
        await msg.respond(response.encode())

    subscription = await nc.subscribe(AUTH_SUBJECT, queue=CALLOUT_QUEUE, cb=answer)  # replicas share the work
    await nc.flush()
    return subscription


async def serve(settings: AuthCalloutSettings) -> None:
    logs.configure("auth-callout", settings.log_level)
    if not settings.issuer_seed:
        raise SystemExit("INFERBUS_CALLOUT_ISSUER_SEED is required (an account nkey seed; see docs/security.md)")
    verify = (
        static_tokens_verifier(settings.tokens_file)
        if settings.tokens_file
        else token_review_verifier(settings.audience)
    )
    authorizer = Authorizer(issuer=nkeys.from_seed(settings.issuer_seed.encode()), account=settings.account,
                            namespace=settings.namespace, verify_token=verify, clock=time.time,
                            ttl_s=settings.user_ttl_s)
    nc = await bus.connect(settings.nats_url, "auth-callout")
    await answer_requests(nc, authorizer)
    log.info("auth_callout_ready", account=settings.account, namespace=settings.namespace)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await nc.close()
