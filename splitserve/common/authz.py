"""Who a caller of the gateway is, and what it may touch.

The token interceptor (``splitserve.common.security``) decides whether a call gets in at all; this
module decides, inside a handler, *who* made it:

* a **client token** (``--auth-token``, each line of ``--token-file``) is one identity: the
  requests it creates belong to it, and only it may read (``GetRequest``) or ``Abort`` them;
* the **admin token** (``--admin-token``) may read and abort every request and sees what is
  internal (worker and metrics addresses in ``GetServerInfo``);
* under **mutual TLS** the client certificate's subject is an identity too; with both a token
  and a certificate the owner is the pair (the same token from another certificate is another
  owner);
* with **no credentials configured** (no token, no mutual TLS) every caller is the same
  anonymous admin: today's open behaviour, meant for loopback and private networks.

What Redis stores as a request's owner is ``token:<first 16 hex digits of sha256(token)>``
(and/or ``x509:<subject>``), never a token: a leaked Redis dump names owners, it grants nothing.

Request ids are scoped by owner (``scoped_id``): inside the service (Redis, the gateway's jobs,
the workers, logs and traces) a request is ``<16 hex digits of sha256(owner)>:<the client's id>``,
so two identities may use the same id at once without meeting, and nobody can take an id
before its owner does. The anonymous owner of an open gateway keeps the client's id as it is.
"""
from __future__ import annotations

import hashlib
import hmac
import uuid
from dataclasses import dataclass
from typing import Iterable, Sequence

from splitserve.common.security import AUTH_METADATA_KEY, AUTH_SCHEME, Security, read_token_file

# Hex digits of the token's sha256 kept in the owner: 64 bits, enough to tell tokens apart.
OWNER_DIGEST_CHARS = 16


@dataclass(frozen=True)
class Caller:
    """The identity behind one call."""

    # Whom the requests this caller creates belong to; "" for the anonymous caller of an open gateway.
    owner: str
    # May read and abort every request and see internal addresses.
    admin: bool

    def may_touch(self, owner: str | None) -> bool:
        """May this caller read or abort a request owned by ``owner`` (None: a record without one)?"""
        return self.admin or (owner or "") == self.owner

    def addressed(self, request_id: str) -> list[str]:
        """The internal ids a ``request_id`` this caller names may stand for, to try in order: its
        own request of that id; for the admin also the id as it is, the full internal id of
        another identity's request (as logs and traces show it)."""
        own = scoped_id(self.owner, request_id)
        return [own, request_id] if self.admin and own != request_id else [own]


def scoped_id(owner: str, request_id: str) -> str:
    """The id a request of ``owner`` is known by inside the service: the client's id after a
    digest of its owner (fixed length, so no two owners' ids can meet), or the id itself for
    the anonymous owner ("": no credentials configured, one namespace as before)."""
    if not owner:
        return request_id
    return hashlib.sha256(owner.encode()).hexdigest()[:OWNER_DIGEST_CHARS] + ":" + request_id


def token_owner(token: str) -> str:
    """The owner a token stands for (a digest: the token itself is never stored)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:OWNER_DIGEST_CHARS]


class Authorizer:
    """The gateway's credentials: who each accepted token is, and whether mutual TLS names callers."""

    def __init__(self, client_tokens: Iterable[str] = (), admin_tokens: Iterable[str] = (),
                 mutual_tls: bool = False) -> None:
        # (sha256 of "Bearer <token>", admin?, owner) per accepted token; digests so every
        # comparison has the same length and takes the same time.
        self._known = [(_digest(AUTH_SCHEME + t), False, token_owner(t)) for t in client_tokens if t]
        self._known += [(_digest(AUTH_SCHEME + t), True, token_owner(t)) for t in admin_tokens if t]
        self.mutual_tls = mutual_tls

    @property
    def open(self) -> bool:
        """No credential names anybody: every caller is the anonymous admin."""
        return not self._known and not self.mutual_tls

    @property
    def tokens_required(self) -> bool:
        """Every call must carry one of the tokens."""
        return bool(self._known)

    def identify(self, authorization: str | None, subject: str = "") -> Caller | None:
        """The caller presenting ``authorization`` (the header's value, "Bearer <token>") and, under
        mutual TLS, the certificate ``subject``; None when a token is required and this is not one."""
        if self.open:
            return Caller("", True)
        admin, parts = False, []
        if authorization is not None:
            digest = _digest(authorization)
            for known, is_admin, owner in self._known:  # no early exit: constant work per token
                if hmac.compare_digest(digest, known):
                    admin = admin or is_admin
                    parts.append(owner)
        if self.tokens_required and not parts:
            return None
        if admin:
            return Caller(parts[0], True)
        if subject:
            parts.append("x509:" + subject)
        return Caller("/".join(parts), False) if parts else _unidentified()

    def caller(self, context) -> Caller:
        """Who made the call of this gRPC handler ``context`` (the interceptor already let it in)."""
        subject = _certificate_subject(context.auth_context()) if self.mutual_tls else ""
        caller = self.identify(_bearer(context.invocation_metadata()), subject)
        return caller if caller is not None else _unidentified()


def _unidentified() -> Caller:
    """A caller nothing names (mutual TLS without a subject): an owner of its own that no later
    caller has, so only the admin may touch what it creates."""
    return Caller("unidentified:" + uuid.uuid4().hex, False)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _bearer(metadata: Sequence | None) -> str | None:
    values = [v for k, v in (metadata or ()) if k == AUTH_METADATA_KEY]
    if len(values) != 1:
        return None
    value = values[0]
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _certificate_subject(auth_context) -> str:
    """The verified client certificate's subject ("CN=alice,O=..."), or its common name."""
    for key in ("x509_subject", "x509_common_name"):
        values = (auth_context or {}).get(key)
        if values:
            return values[0].decode(errors="replace")
    return ""


def gateway_credentials(args):
    """The gateway's (Authorizer, public Security, internal Security) from its flags; a
    configuration that would leave the workers open to the clients exits with why."""
    public = Security.from_args(args)
    internal = Security.internal_from_args(args)
    admin = getattr(args, "admin_token", "") or ""
    clients = [t for t in public.accepted_tokens if t != admin]
    if admin and admin in (args.auth_token, *read_token_file(getattr(args, "token_file", ""))):
        raise SystemExit("--admin-token must differ from every client token (--auth-token, --token-file)")
    if internal.token and internal.token in public.accepted_tokens:
        raise SystemExit("--internal-token must differ from every client and admin token: whoever "
                         "holds it can call the workers directly")
    if (public.accepted_tokens or public.mutual_tls) and not internal.token:
        raise SystemExit("the gateway has client credentials (a token or mutual TLS) but no "
                         "--internal-token (SPLITSERVE_INTERNAL_TOKEN): give one to the gateway and every worker, "
                         "else anyone who reaches a worker's port can call it (Reserve, Prefill...)")
    return Authorizer(clients, [admin], mutual_tls=public.mutual_tls), public, internal
