"""Who may do what on the bus: one NATS identity per service, with subject permissions.

Pure: the permissions of each role, and the nats-server `authorization` block that grants them
(NATS's own security model: users with passwords and per-user publish/subscribe allow lists, see
https://docs.nats.io/running-a-nats-service/configuration/securing_nats/authorization). `inferbus up`
and the test fixtures write it into the server's config; `deploy/` renders the same block into a
Secret. Everything not allowed here is denied, JetStream's API (`$JS.API.>`) and KV (`$KV.>`)
included, so no identity but `ops` can update, purge or delete a stream or bucket, or read one it
has no use for (services create the platform's streams and buckets where they are missing, and
report a configuration that drifted: `bus.ensure_streams`).

Each identity subscribes to its own inbox prefix only (`_INBOX.<user>.>`), so no client can read
the replies (JetStream deliveries, request/reply answers) meant for another.

JetStream lives in an account of its own (`JETSTREAM`, no users), and the services' users in
another (`INFERBUS`) that imports what they use of it: its API, KV puts, acks and flow control,
and the subjects the platform's streams store (service imports), and push consumers' deliveries
to inboxes (a stream import). JetStream answers every call on the reply subject the call names;
through an import that reply goes back to the services' account, where no stream or bucket
stores anything: an answer whose forged reply subject is a KV key, a stream's subject or an API
call is delivered to whoever subscribes to it there and written nowhere (`accounts_block`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from proto import bands, subjects

Role = Literal["ops", "gateway", "router", "billing", "autoscaler", "batch", "worker", "producer"]

_REQ, _USAGE, _RESULTS = subjects.REQUESTS_STREAM, subjects.USAGE_STREAM, subjects.BATCH_RESULTS_STREAM
_PLATFORM_STREAMS = (_REQ, _USAGE, _RESULTS)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may answer requests it received (the router's placements)
    # Replies allowed per request received (NATS's default is one): a streamed internal-producer
    # call is answered with one reply per chunk, for as long as a request may last.
    responses_max: int = 1
    responses_expire: str | None = None


# Answers given at once (a liveness probe's, a placement's, a resend's, a prefill half's): one per
# request received, within a minute of it.
PROMPT_REPLY_EXPIRE = "1m"

# A streamed call's replies: a chunk per token at most (the context window) and the done marker,
# within the longest request deadline a gateway is expected to run with (INFERBUS_REQUEST_TIMEOUT_S).
STREAMED_REPLIES_MAX = 1_000_000
STREAMED_REPLIES_EXPIRE = "1h"


@dataclass(frozen=True)
class Identity:
    """A NATS user: `scope` is the worker, gateway or batch service id its subjects are limited to
    (None for a role-wide identity, such as workers started by an autoscaler)."""

    user: str
    password: str
    role: Role
    scope: str | None = None
    password_env: str = ""  # when set, the server config reads the password from this environment variable

    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)


def inbox_prefix(user: str) -> str:
    return f"_INBOX.{subjects.token(user)}"


def new_password() -> str:
    """192 random bits as letters and digits, starting with a letter: nats-server parses a password
    read from the environment as a config value, where a leading digit or `-` would make it a number."""
    return "ib" + secrets.token_hex(24)



def _stream_info(*streams: str) -> list[str]:
    return [f"$JS.API.STREAM.INFO.{s}" for s in streams]


def _stream_create(*streams: str) -> list[str]:
    """Create the named streams only (a create of an existing stream with the same config is a no-op):
    no identity may create a stream of its own that would capture other subjects."""
    return [f"$JS.API.STREAM.CREATE.{s}" for s in streams]


def _consume(stream: str, *, manage: bool = True) -> list[str]:
    """Create, inspect, pull from and ack on consumers of one stream; with `manage`, also delete
    consumers and get single messages by sequence (which reads past any consumer)."""
    api = "$JS.API"
    rights = [f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
              f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>", f"{api}.CONSUMER.INFO.{stream}.>",
              f"{api}.CONSUMER.MSG.NEXT.{stream}.>", f"{api}.CONSUMER.NAMES.{stream}", f"{api}.CONSUMER.LIST.{stream}",
              f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]
    if manage:
        rights += [f"{api}.CONSUMER.DELETE.{stream}.>", f"{api}.STREAM.MSG.GET.{stream}",
                   f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>"]
    return rights


def _consumer_state(stream: str) -> list[str]:
    """Read the state of a stream's consumers (queue depths), nothing more."""
    return [f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.LIST.{stream}", f"$JS.API.CONSUMER.NAMES.{stream}"]


def _kv_read(bucket: str) -> list[str]:
    return [*_stream_info(f"KV_{bucket}"), *_stream_create(f"KV_{bucket}"), *_consume(f"KV_{bucket}")]


def _kv_get(bucket: str) -> list[str]:
    """Read single keys of a bucket (direct and leader gets), nothing more."""
    stream = f"KV_{bucket}"
    return [*_stream_info(stream), f"$JS.API.DIRECT.GET.{stream}.>", f"$JS.API.STREAM.MSG.GET.{stream}"]


def _kv_write(bucket: str, key: str = ">") -> list[str]:
    return [*_kv_read(bucket), f"$KV.{bucket}.{key}"]


def _platform_streams() -> list[str]:
    """What `bus.ensure_streams` needs: see and create the platform's three streams."""
    return [*_stream_info(*_PLATFORM_STREAMS), *_stream_create(*_PLATFORM_STREAMS), "$JS.API.INFO"]


# Prefill/decode disaggregation (services/worker/decode_side.py, prefill_side.py), what it adds to
# a worker's rights: (subject scoped to the worker, role-wide subject) per rule.
_WORKER_PD_PUBLISH: tuple[tuple[Callable[[str], str] | None, Callable[[], str]], ...] = (
    (subjects.prefill_subjects_from, subjects.prefill_wildcard),  # its prefill halves, naming itself the decode side
    (None, subjects.prefilled_wildcard),  # how a half ended, to the decode worker that sent it
    (None, subjects.placement_wildcard),  # asks a router for a prefill worker
    (None, subjects.liveness_wildcard),  # probes a prefill worker whose heartbeat lapsed
)
_WORKER_PD_SUBSCRIBE: tuple[tuple[Callable[[str], str] | None, Callable[[], str]], ...] = (
    (subjects.prefill_subjects_to, subjects.prefill_wildcard),  # halves sent to it
    (subjects.prefilled_subject, subjects.prefilled_wildcard),  # reports on the halves it sent
)


def _rules(
    table: tuple[tuple[Callable[[str], str] | None, Callable[[], str]], ...], scope: str | None
) -> tuple[str, ...]:
    return tuple(scoped(scope) if scoped is not None and scope is not None else wide() for scoped, wide in table)


def permissions(role: Role, user: str, scope: str | None = None) -> Permissions:
    """The subjects `user` (of `role`, limited to `scope` where the role has one) may use."""
    inbox = f"{inbox_prefix(user)}.>"
    if role == "ops":
        return Permissions(publish=(">",), subscribe=(">",))
    if role == "worker":
        return Permissions(
            publish=(
                # Stream events to the gateway named in each request's reply_to, as itself (the last token).
                subjects.event_publish_wildcard(scope),
                # Usage of the attempts it ran, reported as itself (billing checks it holds them).
                subjects.usage_publish_wildcard(subjects.USAGE_FROM_WORKER, scope),
                subjects.metrics_subject(scope) if scope is not None else subjects.metrics_wildcard(),
                subjects.cache_subject(scope) if scope is not None else subjects.cache_wildcard(),
                # A batch line's result, as itself (the batch service takes it from the line's holder only).
                subjects.batch_result_publish_wildcard(subjects.RESULT_FROM_WORKER, scope),
                # A batch line handed back (preempted, draining): its batch service queues the next
                # attempt; a worker creates no work of its own.
                subjects.requeue_wildcard(),
                # Its consumers on REQUESTS, but no reading queued requests by sequence, nor
                # deleting another worker's consumer.
                *_platform_streams(), *_consume(_REQ, manage=False), *_kv_read(subjects.WORKERS_BUCKET),
                f"$KV.{subjects.WORKERS_BUCKET}.{subjects.worker_key(scope) if scope is not None else '*'}",
                *_kv_write(subjects.CLAIMS_BUCKET),  # claims the attempts it runs (any request's)
                *_kv_read(subjects.ADAPTERS_BUCKET),
                *_kv_read(subjects.MODELS_BUCKET),  # the release it must verify it serves
                # For whom each interactive request was dispatched: it runs no other.
                *_kv_get(subjects.DISPATCHES_BUCKET),
                *_rules(_WORKER_PD_PUBLISH, scope),
            ),
            subscribe=(subjects.cancel_wildcard(),
                       subjects.control_subject(scope) if scope is not None else subjects.control_wildcard(),
                       subjects.liveness_subject(scope) if scope is not None else subjects.liveness_wildcard(),
                       subjects.resend_worker_subjects(scope) if scope is not None else subjects.resend_wildcard(),
                       subjects.holder_wildcard(),
                       *_rules(_WORKER_PD_SUBSCRIBE, scope),
                       inbox),
            # answers the gateways' liveness probes and requests to resend, prefill halves
            allow_responses=True, responses_expire=PROMPT_REPLY_EXPIRE,
        )
    if role == "gateway":
        return Permissions(
            publish=(
                # Requests whose replies come back to itself only (the subject's last token names
                # the owner of reply_to; workers refuse any other reply_to).
                *(
                    subjects.owned_request_wildcards(scope)
                    if scope is not None
                    else subjects.requests_stream_subjects()
                ),
                subjects.cancel_subjects_of(scope) if scope is not None else subjects.cancel_wildcard(),
                # Usage of its own requests that no worker finished, reported as itself.
                subjects.usage_publish_wildcard(subjects.USAGE_FROM_OWNER, scope),
                subjects.placement_wildcard(),
                *_platform_streams(),
                *_consumer_state(_REQ),
                *_kv_read(subjects.WORKERS_BUCKET),
                *_kv_write(subjects.BATCHES_BUCKET),
                *_kv_write(subjects.FILES_BUCKET),
                *_kv_write(subjects.ADAPTERS_BUCKET),
                *_kv_write(subjects.MODELS_BUCKET),
                *_kv_write(subjects.RESPONSES_BUCKET),
                # Who dispatched each of its requests, for which tenant (billing checks a worker's usage).
                *_kv_write(subjects.DISPATCHES_BUCKET),
                subjects.liveness_wildcard(),  # probes a worker whose heartbeat lapsed
                # asks a worker to send its own streams' events again (a gap, or silence)
                subjects.resend_subjects_of(scope) if scope is not None else subjects.resend_wildcard(),
                subjects.holder_subject(scope) if scope is not None else subjects.holder_wildcard(),
            ),
            subscribe=(
                subjects.event_filter(scope) if scope is not None else subjects.event_publish_wildcard(),
                subjects.metrics_wildcard(),
                inbox,
                # Internal producers' calls (answered as replies) and their cancels.
                subjects.api_wildcard(),
                subjects.api_cancel_wildcard(scope) if scope is not None else subjects.api_cancel_all(),
                # The web console shows the autoscaler's and the canary controller's decisions.
                subjects.scale_wildcard(),
                subjects.release_wildcard(),
            ),
            allow_responses=True,
            responses_max=STREAMED_REPLIES_MAX,
            responses_expire=STREAMED_REPLIES_EXPIRE,
        )
    if role == "router":
        return Permissions(
            publish=(
                subjects.placed_wildcard(), subjects.control_wildcard(),
                # A dead worker's queue, moved to the shared one. Interactive bands only: workers have
                # no queue of their own for batch lines, so the router has none to move, and only the
                # batch service creates them.
                *(subjects.shared_request_wildcard(band) for band in bands.INTERACTIVE),
                *_platform_streams(), *_consume(_REQ), *_kv_read(subjects.WORKERS_BUCKET),
                *_kv_read(subjects.ADAPTERS_BUCKET),  # registered adapters, to prefetch them
                # The canary controller: rollouts (compare-and-set) and its decisions; an adapter
                # canary's end settles the adapter's registration.
                *_kv_write(subjects.MODELS_BUCKET, "rollout.>"), subjects.release_wildcard(),
                *_kv_write(subjects.ADAPTERS_BUCKET),
            ),
            subscribe=(subjects.placement_wildcard(), subjects.placed_wildcard(), subjects.cache_wildcard(),
                       subjects.metrics_wildcard(), inbox),
            allow_responses=True, responses_expire=PROMPT_REPLY_EXPIRE,  # answers placement questions
        )
    if role == "billing":
        # Reads `claims` (which worker holds each attempt) and `dispatches` (for which tenant each
        # request was dispatched) to refuse usage a worker may not report.
        return Permissions(publish=(*_platform_streams(), *_consume(_USAGE), *_kv_get(subjects.CLAIMS_BUCKET),
                                    *_kv_get(subjects.DISPATCHES_BUCKET)),
                           subscribe=(inbox,))
    if role == "autoscaler":
        return Permissions(
            publish=(subjects.control_wildcard(), subjects.scale_wildcard(), *_platform_streams(),
                     *_consumer_state(_REQ), *_kv_read(subjects.WORKERS_BUCKET)),
            subscribe=(subjects.metrics_wildcard(), inbox),
        )
    if role == "batch":
        # The batch service's gateway-like id: its lines' reply_to is `token_subject("batch-<id>")`.
        me = None if scope is None else f"batch-{scope}"
        return Permissions(
            publish=(
                subjects.shared_request_wildcard("batch", me),
                subjects.cancel_wildcard() if me is None else subjects.cancel_subjects_of(me),
                # Its lines' results as it records them (what readers count), as itself.
                subjects.batch_result_publish_wildcard(subjects.RESULT_FROM_OWNER, me),
                *_platform_streams(), *_consumer_state(_REQ), *_consume(_RESULTS),
                *_kv_read(subjects.WORKERS_BUCKET), *_kv_write(subjects.BATCHES_BUCKET),
                *_kv_write(subjects.FILES_BUCKET), *_kv_read(subjects.ADAPTERS_BUCKET),
                *_kv_write(subjects.DISPATCHES_BUCKET),  # its lines' dispatch records
            ),
            subscribe=(subjects.event_publish_wildcard() if me is None else subjects.event_filter(me),
                       subjects.requeue_wildcard() if me is None else subjects.requeue_subject(me),
                       subjects.metrics_wildcard(), inbox),
            allow_responses=True, responses_expire=PROMPT_REPLY_EXPIRE,  # answers lines handed back
        )
    if role == "producer":
        # An internal producer: the OpenAI API over NATS, authenticated by a tenant API key and
        # admitted by a gateway like an HTTP call; nothing else on the bus.
        return Permissions(publish=(subjects.api_wildcard(), subjects.api_cancel_all()), subscribe=(inbox,))
    raise ValueError(f"unknown role {role!r}")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _subjects(items: tuple[str, ...], indent: str) -> str:
    return "[\n" + "".join(f"{indent}  {_quote(s)}\n" for s in items) + f"{indent}]"


SERVICES_ACCOUNT = "INFERBUS"  # the services' users (and, with auth callout, every pod's)
JETSTREAM_ACCOUNT = "JETSTREAM"  # JetStream's streams and buckets; no user connects to it


def jetstream_services() -> tuple[tuple[str, bool], ...]:
    """What the services' account calls in JetStream's, as (subject, answered with several
    replies): the API (a pull request is answered with a message per reply), KV puts, acks, flow
    control, and the subjects the platform's streams store."""
    stored = (*subjects.requests_stream_subjects(), *subjects.usage_stream_subjects(),
              *subjects.batch_results_stream_subjects())
    return (("$JS.API.>", True), ("$KV.>", False), ("$JS.ACK.>", False), ("$JS.FC.>", False),
            *((subject, False) for subject in stored))


# What JetStream's account sends the services' (a stream export): push consumers' deliveries
# (KV watches, ordered consumers) to the inbox they were created with.
JETSTREAM_DELIVERIES = "_INBOX.>"


def jetstream_account() -> str:
    """The JETSTREAM account of nats-server's `accounts` block: JetStream enabled, no users, its
    API, KV and stream subjects exported as services, push deliveries as a stream."""
    exports = [f"{{ service: {_quote(subject)}{', response_type: stream' if several else ''} }}"
               for subject, several in jetstream_services()]
    exports.append(f"{{ stream: {_quote(JETSTREAM_DELIVERIES)} }}")
    return "\n".join([f"  {JETSTREAM_ACCOUNT} {{", "    jetstream: enabled", "    exports: [",
                      *(f"      {export}" for export in exports), "    ]", "  }"])


def services_imports() -> list[str]:
    """The services' account's imports of JETSTREAM's exports (each under its own name)."""
    imports = [f"{{ service: {{ account: {JETSTREAM_ACCOUNT}, subject: {_quote(subject)} }} }}"
               for subject, _ in jetstream_services()]
    imports.append(f"{{ stream: {{ account: {JETSTREAM_ACCOUNT}, subject: {_quote(JETSTREAM_DELIVERIES)} }} }}")
    return imports


def accounts_block(identities: list[Identity]) -> str:
    """nats-server's `accounts { JETSTREAM {...} INFERBUS { users = [...] } }`: only these users
    may connect, each with its role's permissions, all in the services' account, which reaches
    JetStream through imports only; a client without credentials is refused."""
    lines = ["accounts {", jetstream_account(), f"  {SERVICES_ACCOUNT} {{", "  users = ["]
    for identity in identities:
        p = permissions(identity.role, identity.user, identity.scope)
        lines += [
            "    {",
            f"      user: {_quote(identity.user)}",
            f"      password: ${identity.password_env}" if identity.password_env else
            f"      password: {_quote(identity.password)}",
            "      permissions: {",
            f"        publish: {{ allow: {_subjects(p.publish, '        ')} }}",
            f"        subscribe: {{ allow: {_subjects(p.subscribe, '        ')} }}",
        ]
        if p.allow_responses and p.responses_max == 1 and p.responses_expire is None:
            lines.append("        allow_responses: true")
        elif p.allow_responses:
            expires = f", expires: \"{p.responses_expire}\"" if p.responses_expire else ""
            lines.append(f"        allow_responses: {{ max: {p.responses_max}{expires} }}")
        lines += ["      }", "    }"]
    lines += ["  ]", "  imports: [", *(f"    {i}" for i in services_imports()), "  ]", "  }", "}"]
    return "\n".join(lines) + "\n"


@dataclass
class LocalIdentities:
    """The identities of a local platform (`inferbus up`, the test fixtures): one per service and
    per static worker, a role-wide one for workers an autoscaler starts, `producer` for internal
    producers (the OpenAI API over NATS), and `ops` for the operator."""

    gateway_id: str
    batch_id: str
    workers: list[str]
    by_name: dict[str, Identity] = field(default_factory=dict)
    gateways: list[str] = field(default_factory=list)  # more gateways (one per zone), each its own identity

    def __post_init__(self) -> None:
        wanted: list[tuple[str, Role, str | None]] = [
            ("ops", "ops", None), ("gateway", "gateway", self.gateway_id), ("router", "router", None),
            ("billing", "billing", None), ("autoscaler", "autoscaler", None), ("batch", "batch", self.batch_id),
            ("worker", "worker", None), ("producer", "producer", None), *[(w, "worker", w) for w in self.workers],
            *[(g, "gateway", g) for g in self.gateways],
        ]
        for name, role, scope in wanted:
            if name not in self.by_name:
                self.by_name[name] = Identity(name, new_password(), role, scope)

    def __getitem__(self, name: str) -> Identity:
        return self.by_name[name]

    def all(self) -> list[Identity]:
        return list(self.by_name.values())


# The identities of a deployment (deploy/): one per service role, shared by the replicas of that role
# (they run the same image with the same Secret), passwords from the environment of nats-server.
DEPLOYMENT_ROLES: tuple[tuple[str, Role, str | None], ...] = (
    ("ops", "ops", None), ("gateway", "gateway", None), ("router", "router", None), ("billing", "billing", None),
    ("autoscaler", "autoscaler", None), ("batch", "batch", "main"), ("worker", "worker", None),
    ("producer", "producer", None),
)
REDIS_PASSWORD_ENV = "REDIS_PASSWORD"
ROUTE_PASSWORD_ENV = "NATS_ROUTE_PASSWORD"


def password_env(user: str) -> str:
    """The environment variable (and Secret key) holding `user`'s NATS password in a deployment."""
    return "NATS_PASSWORD_" + user.upper().replace("-", "_")


def deployment_identities() -> list[Identity]:
    return [Identity(user, "", role, scope, password_env(user)) for user, role, scope in DEPLOYMENT_ROLES]


def deployment_auth_config() -> str:
    """deploy/k8s/base/nats-auth.conf (also used by docker-compose.yml): generated by
    `inferbus bus-config`, kept in sync by a test."""
    header = (
        "# Generated by `inferbus bus-config > deploy/k8s/base/nats-auth.conf` from inferbus/bus/auth.py; a test\n"
        "# keeps it in sync. Passwords come from nats-server's environment (the inferbus-bus Secret).\n"
    )
    return header + accounts_block(deployment_identities())


def new_secrets() -> dict[str, str]:
    """Fresh passwords for a deployment: every NATS identity's and Redis's, by environment name."""
    found = {password_env(user): new_password() for user, _, _ in DEPLOYMENT_ROLES}
    found[REDIS_PASSWORD_ENV] = new_password()
    found[ROUTE_PASSWORD_ENV] = new_password()  # the NATS cluster's routes (deploy/k8s/base/nats.conf)
    return found
