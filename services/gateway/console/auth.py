"""Who is looking at the console: sessions made from an API key or the admin key, and CSRF checks.

- **Sign-in.** A tenant signs in with one of its API keys, an operator with the admin key
  (`INFERBUS_ADMIN_KEY`). The key is checked as the API checks it and then forgotten: the session
  keeps the SHA-256 of the key only, so that every page can check the key still exists (revoking
  it ends every session made from it at once).
- **Sessions** live in Redis (`inferbus:console:session:<sha256 of the cookie>`; a reader of Redis
  cannot use what it finds there), expire after `idle_s` without a page view and `max_age_s` after
  sign-in, and end on sign-out. The cookie is HttpOnly, SameSite=Strict, limited to /console, and
  Secure when the console is reached over HTTPS.
- **CSRF.** Every form that changes something carries the session's random token, compared in
  constant time; a request whose Origin (or Sec-Fetch-Site) says another site is refused even
  with it. The sign-in form has its own token in a short-lived cookie (double submit), so no other
  site can sign a browser in with the attacker's key.
- **Bearer keys.** Scripts may send `Authorization: Bearer <key>` instead of a cookie (a tenant
  key: that tenant's pages and CSV; the admin key: the operator's); such requests carry no ambient
  credential, so they need no CSRF token.

A tenant's session names its tenant, and every page reads that tenant's records only: no
parameter of any console URL names a tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import msgspec
import redis.asyncio as aioredis
from starlette.requests import Request

from inferbus.stores.keys import KEY_PREFIX, KeyStore, Principal, hash_secret

SESSION_COOKIE = "inferbus_console"
LOGIN_COOKIE = "inferbus_console_login"
COOKIE_PATH = "/console"
SESSION_PREFIX = "inferbus:console:session:"
Role = Literal["tenant", "admin"]


class Session(msgspec.Struct, kw_only=True):
    role: Role
    tenant: str = ""  # "" for an operator
    key_id: str = ""
    key_hash: str  # SHA-256 of the key signed in with (the admin key's, for an operator)
    csrf: str
    created: float


@dataclass(frozen=True)
class Viewer:
    """Whoever makes this request: an operator, or one tenant through one of its keys."""

    role: Role
    tenant: str
    key_id: str
    csrf: str  # "" when authenticated by a bearer key (no form needs it)
    session_id: str = ""  # the cookie's value, "" for a bearer key

    @property
    def admin(self) -> bool:
        return self.role == "admin"


class NotSignedIn(Exception):
    """No valid session or key: pages send the browser to the sign-in form."""


class Forbidden(Exception):
    """A signed-in viewer asked for what is not theirs (a CSRF check failed, or a page of the other role)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _session_key(session_id: str) -> str:
    return SESSION_PREFIX + hashlib.sha256(session_id.encode()).hexdigest()


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Session).decode


class Sessions:
    def __init__(self, redis: aioredis.Redis, keys: KeyStore, admin_key: str, *, idle_s: float = 3600.0,
                 max_age_s: float = 12 * 3600.0) -> None:
        self.redis = redis
        self.keys = keys
        self.admin_key = admin_key
        self.idle_s = idle_s
        self.max_age_s = max_age_s

    # ---- signing in with a key -------------------------------------------------------------------

    async def identify(self, secret: str) -> Session | None:
        """The session a key would open (not stored yet), or None if it is no key of ours."""
        secret = secret.strip()
        if not secret:
            return None
        now = time.time()
        if self.admin_key and hmac.compare_digest(secret.encode(), self.admin_key.encode()):
            return Session(role="admin", key_hash=hash_secret(secret), csrf=secrets.token_urlsafe(32), created=now)
        principal: Principal | None = await self.keys.lookup(secret)
        if principal is None:
            return None
        return Session(role="tenant", tenant=principal.tenant, key_id=principal.key_id, key_hash=hash_secret(secret),
                       csrf=secrets.token_urlsafe(32), created=now)

    async def open(self, session: Session) -> str:
        """Store `session`; returns the cookie value that names it."""
        session_id = secrets.token_urlsafe(32)
        await self.redis.set(_session_key(session_id), _encode(session), ex=int(self.idle_s))
        return session_id

    async def close(self, session_id: str) -> None:
        await self.redis.delete(_session_key(session_id))

    # ---- each request ----------------------------------------------------------------------------

    async def _still_valid(self, session: Session) -> bool:
        if session.role == "admin":
            return bool(self.admin_key) and hmac.compare_digest(session.key_hash, hash_secret(self.admin_key))
        return bool(await self.redis.exists(KEY_PREFIX + session.key_hash))

    async def viewer(self, request: Request) -> Viewer:
        """The viewer of `request`, by bearer key or session cookie; NotSignedIn otherwise."""
        scheme, _, secret = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and secret.strip():
            found = await self.identify(secret)
            if found is None:
                raise NotSignedIn()
            return Viewer(role=found.role, tenant=found.tenant, key_id=found.key_id, csrf="")
        session_id = request.cookies.get(SESSION_COOKIE, "")
        if not session_id:
            raise NotSignedIn()
        key = _session_key(session_id)
        raw = await self.redis.get(key)
        if raw is None:
            raise NotSignedIn()
        session = _decode(raw)
        if time.time() - session.created > self.max_age_s or not await self._still_valid(session):
            await self.redis.delete(key)
            raise NotSignedIn()
        await self.redis.expire(key, int(self.idle_s))
        return Viewer(role=session.role, tenant=session.tenant, key_id=session.key_id, csrf=session.csrf,
                      session_id=session_id)


# ---- CSRF ----------------------------------------------------------------------------------------

def same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another site (Origin, Sec-Fetch-Site)."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True  # not every browser sends it on a same-origin form; the token still has to match
    parts = urlsplit(origin)
    host = request.headers.get("host", "")
    return parts.netloc == host and parts.scheme in ("http", "https")


def check_csrf(request: Request, viewer: Viewer, token: str | None) -> None:
    """A form that changes something: its token must be the session's, from this site."""
    if not viewer.session_id:
        return  # a bearer key: no cookie, nothing another site could make the browser send
    if not same_origin(request):
        raise Forbidden("This form was sent from another site.")
    if not token or not hmac.compare_digest(token.encode(), viewer.csrf.encode()):
        raise Forbidden("The form's security token is missing or out of date: reload the page and try again.")


def check_login_csrf(request: Request, token: str | None) -> None:
    """The sign-in form: its token must match the one its page set in a cookie (double submit)."""
    cookie = request.cookies.get(LOGIN_COOKIE, "")
    if not same_origin(request) or not token or not cookie or not hmac.compare_digest(token.encode(), cookie.encode()):
        raise Forbidden("The sign-in form's security token is missing or out of date: reload the page and try again.")
