"""Per-pod NATS identities through NATS auth callout: the decision (pure, injected clock and token
verifier) and its JWTs.

A static nats-server config can only name users in advance, and a replicated Kubernetes workload
cannot give each replica a password of its own (docs/security.md). With auth callout (nats-server
2.10+, https://docs.nats.io/running-a-nats-service/configuration/securing_nats/auth_callout) the
server asks a service for every connection: the client presents its pod's projected
ServiceAccount token (audience-bound, expiring, naming the pod), the service verifies it (a
Kubernetes `TokenReview` in a deployment) and answers with a user JWT whose permissions are
`bus_auth.permissions(role, pod, scope=pod)`: the role from the pod's ServiceAccount, every
subject scoped to the pod's own name, which the pod also uses as its gateway or worker id and as
its NATS user (the inbox prefix). The batch service, one per platform, keeps its stable id as
its scope (`fixed_scopes`).

The JWTs are NATS's (header `{"typ": "JWT", "alg": "ed25519-nkey"}`, claims signed with an
account nkey): the server's authorization request, signed by the server; our authorization
response and the user JWT inside it, signed by the issuer account key the server is configured
with (`auth_callout { issuer: <its public key> }`). Keys are nkeys (the `nkeys` library).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nkeys
from nacl.signing import VerifyKey

from inferbus.bus.auth import SERVICES_ACCOUNT, Permissions, Role, jetstream_account, permissions, services_imports

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"  # where nats-server sends authorization requests
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}

# The ServiceAccount a pod runs as decides its role: deploy/k8s/per-pod-identities gives each
# service a ServiceAccount named like it; `producer` is for internal producers' pods.
ROLE_BY_SERVICE_ACCOUNT: dict[str, Role] = {
    "gateway": "gateway", "worker": "worker", "router": "router", "billing": "billing", "batch": "batch",
    "autoscaler": "autoscaler", "producer": "producer",
}


@dataclass(frozen=True)
class PodIdentity:
    """Who a verified ServiceAccount token belongs to."""

    namespace: str
    service_account: str
    pod: str


class CalloutError(Exception):
    """A connection the callout refuses (the reason goes back to the server, which logs it)."""


def new_account_seed() -> bytes:
    """A new account nkey seed (`SA…`): the issuer the server trusts for callout answers."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode_jwt(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """A NATS JWT of `claims` signed by `signer`; `jti` is the hash of the claims, as NATS's own."""
    claims = {**claims, "jti": ""}
    claims["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode().rstrip("=")
    )
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def decode_jwt(token: str, issuer_prefix: bytes = b"N") -> dict[str, Any]:
    """The claims of a NATS JWT whose signature verifies with its own `iss` (a public nkey that
    must start with `issuer_prefix`: `N` for a server). Raises CalloutError otherwise."""
    try:
        header, payload, signature = token.split(".")
        if json.loads(_unb64(header)).get("alg") != _HEADER["alg"]:
            raise CalloutError("not an nkey-signed JWT")
        claims = json.loads(_unb64(payload))
        issuer = str(claims.get("iss", "")).encode()
        if not issuer.startswith(issuer_prefix):
            raise CalloutError("JWT not issued by a server")
        VerifyKey(_public_key_bytes(issuer)).verify(f"{header}.{payload}".encode(), _unb64(signature))
    except CalloutError:
        raise
    except Exception as error:  # malformed base64/JSON, bad key, bad signature
        raise CalloutError(f"invalid authorization request: {error!r}") from None
    return claims


def _public_key_bytes(public_nkey: bytes) -> bytes:
    """The Ed25519 key inside a public nkey (base32 of a prefix byte, the key and a CRC-16)."""
    raw = base64.b32decode(public_nkey + b"=" * (-len(public_nkey) % 8))
    if len(raw) != 35 or nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
        raise CalloutError("malformed public nkey")
    return raw[1:-2]


def user_permissions_claims(p: Permissions) -> dict[str, Any]:
    """bus_auth's Permissions as a user JWT's `nats` permissions."""
    claims: dict[str, Any] = {"pub": {"allow": list(p.publish)}, "sub": {"allow": list(p.subscribe)}}
    if p.allow_responses:
        response: dict[str, Any] = {"max": p.responses_max}
        if p.responses_expire:
            response["ttl"] = _duration_ns(p.responses_expire)
        claims["resp"] = response
    return claims


def _duration_ns(text: str) -> int:
    units = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
    for suffix in ("ms", "s", "m", "h"):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * units[suffix]
    raise ValueError(f"unsupported duration {text!r}")


@dataclass
class Authorizer:
    """Answers nats-server's authorization requests: a pod with a valid ServiceAccount token of
    `namespace` and a known ServiceAccount gets its role's permissions scoped to its pod name;
    everything else is refused."""

    issuer: nkeys.KeyPair  # the account key whose public key the server's auth_callout.issuer names
    account: str  # the account users are placed in (the server's platform account)
    namespace: str
    verify_token: Callable[[str], PodIdentity | None]  # None: not a valid token
    clock: Callable[[], float]
    ttl_s: float = 3600.0  # a user JWT's lifetime; the server drops the connection when it expires
    # Roles whose scope is a fixed id rather than the pod's name: the batch service runs once per
    # platform, and its id must outlive its pod (lines published before a restart still report to
    # it and can still be cancelled by it; INFERBUS_BATCH_SERVICE_ID, "main" by default).
    fixed_scopes: dict[str, str] = field(default_factory=lambda: {"batch": "main"})

    def decide(self, connect_opts: dict[str, Any]) -> tuple[str, Permissions]:
        """(NATS user name, permissions) for a client's CONNECT options; CalloutError to refuse."""
        token = connect_opts.get("auth_token")
        if not token:
            raise CalloutError("no ServiceAccount token (auth_token)")
        pod = self.verify_token(str(token))
        if pod is None:
            raise CalloutError("ServiceAccount token not valid")
        if pod.namespace != self.namespace:
            raise CalloutError(f"pod of namespace {pod.namespace!r}, not {self.namespace!r}")
        role = ROLE_BY_SERVICE_ACCOUNT.get(pod.service_account)
        if role is None:
            raise CalloutError(f"ServiceAccount {pod.service_account!r} has no role on the bus")
        claimed = connect_opts.get("user")
        if claimed and claimed != pod.pod:
            raise CalloutError(f"user {claimed!r} is not the pod's name {pod.pod!r}")
        return pod.pod, permissions(role, pod.pod, self.fixed_scopes.get(role, pod.pod))

    def respond(self, request_jwt: str) -> str:
        """The signed authorization response to a server's signed authorization request."""
        claims = decode_jwt(request_jwt)
        request = claims.get("nats") or {}
        server_id = str((request.get("server_id") or {}).get("id", ""))
        user_nkey = str(request.get("user_nkey", ""))
        now = int(self.clock())
        response: dict[str, Any] = {"type": "authorization_response", "version": 2}
        try:
            user, granted = self.decide(request.get("connect_opts") or {})
        except CalloutError as error:
            response["error"] = str(error)
        else:
            response["jwt"] = encode_jwt({
                "aud": self.account, "sub": user_nkey, "iss": self.issuer.public_key.decode(), "name": user,
                "iat": now, "exp": now + int(self.ttl_s),
                "nats": {**user_permissions_claims(granted), "subs": -1, "data": -1, "payload": -1,
                         "type": "user", "version": 2},
            }, self.issuer)
        return encode_jwt({"aud": server_id, "sub": user_nkey, "iss": self.issuer.public_key.decode(), "iat": now,
                           "nats": response}, self.issuer)


def _value(text: str) -> str:
    """A config value: `$NAME` (read from nats-server's environment) as is, anything else quoted."""
    return text if text.startswith("$") else json.dumps(text)


def server_config(issuer_public_key: str, account: str, auth_user: str, auth_password: str,
                  static_users: tuple[tuple[str, str], ...] = ()) -> str:
    """nats-server's accounts and `auth_callout` block: `auth_user` (the callout service) and
    `static_users` (user, password: e.g. the operator's `ops`, with every right) connect with
    passwords and skip the callout; every other client is authorized by the callout. Values
    starting with `$` are environment references (a deployment's Secret). JetStream is in an
    account of its own that `account` imports (`bus_auth.accounts_block`)."""
    users = [(auth_user, auth_password), *static_users]
    # The callout service may answer authorization requests and do nothing else.
    callout_rights = ('permissions: { subscribe: { allow: ["$SYS.REQ.USER.AUTH"] }, publish: { deny: [">"] }, '
                      "allow_responses: true }")
    entries = ", ".join(f"{{ user: {json.dumps(u)}, password: {_value(pw)}"
                        f"{', ' + callout_rights if u == auth_user else ''} }}" for u, pw in users)
    return "\n".join([
        "accounts {",
        jetstream_account(),
        f"  {account} {{ users: [ {entries} ],",
        f"    imports: [ {', '.join(services_imports())} ] }}",
        "  SYS {}",
        "}",
        "system_account: SYS",
        "authorization {",
        "  auth_callout {",
        f"    issuer: {_value(issuer_public_key)}",
        f"    auth_users: [ {', '.join(json.dumps(u) for u, _ in users)} ]",
        f"    account: {account}",
        "  }",
        "}",
        "",
    ])


CALLOUT_ACCOUNT = SERVICES_ACCOUNT
ISSUER_ENV = "INFERBUS_CALLOUT_ISSUER"  # the issuer's public key, in nats-server's environment
AUTH_PASSWORD_ENV = "NATS_PASSWORD_AUTH"


def deployment_callout_config() -> str:
    """deploy/k8s/per-pod-identities/nats-auth.conf: the deployment's accounts and auth_callout,
    secrets from nats-server's environment (the inferbus-callout and inferbus-bus Secrets).
    Generated by `inferbus bus-config --callout`, kept in sync by a test."""
    from inferbus.bus.auth import password_env

    header = ("# Generated by `inferbus bus-config --callout > deploy/k8s/per-pod-identities/nats-auth.conf` from\n"
              "# inferbus/bus/callout.py; a test keeps it in sync. Every client but `auth` (the callout service) and\n"
              "# `ops` (the operator) is authorized by `inferbus auth-callout` with its pod's ServiceAccount token.\n")
    return header + server_config("$" + ISSUER_ENV, CALLOUT_ACCOUNT, "auth", "$" + AUTH_PASSWORD_ENV,
                                  (("ops", "$" + password_env("ops")),))
