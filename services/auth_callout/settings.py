from __future__ import annotations

from dataclasses import dataclass

from inferbus.runtime import settings as shared
from inferbus.runtime.settings import env


@dataclass(frozen=True)
class AuthCalloutSettings:
    nats_url: str = shared.nats_url("NATS server (2.10+) whose auth_callout names this service's user "
                        "(NATS_USER/NATS_PASSWORD, one of its auth_users).")
    issuer_seed: str = env(
        "INFERBUS_CALLOUT_ISSUER_SEED",
        "",
        "Account nkey seed (SA…) signing the answers and user JWTs; "
        "the server's auth_callout.issuer is its public key (`inferbus callout-keys`). Required.",
    )
    account: str = env(
        "INFERBUS_CALLOUT_ACCOUNT",
        "INFERBUS",
        "Account the authorized pods are placed in (the server's platform account, with JetStream).",
    )
    namespace: str = env(
        "INFERBUS_CALLOUT_NAMESPACE", "inferbus", "Only pods of this Kubernetes namespace are authorized."
    )
    audience: str = env("INFERBUS_CALLOUT_AUDIENCE", "nats", "Audience the pods' projected ServiceAccount tokens are "
                        "issued for (serviceAccountToken.audience); a token for another audience is refused.")
    tokens_file: str = env("INFERBUS_CALLOUT_TOKENS_FILE", "", "Instead of the Kubernetes API: a JSON file of static "
                           "tokens, {token: {namespace, service_account, pod}} (a local platform: `inferbus up "
                           "--callout`). Empty: TokenReview, from inside the cluster.")
    user_ttl_s: float = env(
        "INFERBUS_CALLOUT_USER_TTL_S",
        3600.0,
        "Lifetime of an issued user JWT: the server closes the "
        "connection then and the client reconnects with its current token.",
    )
    log_level: str = shared.log_level()
