"""Transport security and authentication of every gRPC port, in one place.

One ``Security`` per process, built from its flags (``Security.from_args``):

* ``cert`` + ``key`` (``--tls-cert``/``--tls-key``): the port serves TLS only.
* ``ca`` (``--tls-ca``): on a server with a cert, client certificates are *required* and
  verified against it (mutual TLS); on the client side (the gateway's calls to workers,
  ``splitserve generate``, ``Client``) it is the root that server certificates must chain to.
  Where a cert and key are given, the client side presents them too, so one cert/key/CA per
  deployment secures every internal hop. Such a cert needs ``subjectAltName`` entries for
  every name and IP the workers advertise (``--advertise-host``/``--host``) and, for mutual
  TLS, an extended key usage of both ``serverAuth`` and ``clientAuth`` (or none at all).
* ``token``: every call must carry ``authorization: Bearer <token>`` metadata (or one of
  ``more_tokens``), or it fails with ``UNAUTHENTICATED``. ``grpc.health.v1.Health`` stays open
  so load balancers and orchestrators can probe; reflection needs a token like the rest.
  The client side attaches ``token`` to every call it makes.
* ``max_message_bytes`` (``--max-message-mb``): the largest message a port accepts or sends.
* ``kv_key``: derived from ``token``; the workers' tcp KV socket admits only senders that prove
  it (a challenge-response per connection, ``splitserve/kvtransfer/transports/tcp_auth.py``).
* ``registry_key``: derived from ``token``; workers sign their Redis registry record with it and
  the gateway routes to no record that it does not verify (``splitserve.state.store``), so
  whoever can write to Redis but lacks the token cannot pose as a worker.

Two sides, two sets of tokens (``from_args`` and ``internal_from_args``):

* the gateway's public port accepts the clients' tokens (``--auth-token``, ``--token-file``)
  and the admin token (``--admin-token``); who is who is ``splitserve.common.authz``'s business;
* a worker's port accepts only ``--internal-token``, and the gateway sends it on its calls to
  the workers, so a client token cannot call ``Reserve`` or ``Prefill`` directly.

No bytes that arrive from the network are ever unpickled anywhere in splitserve (protobuf,
JSON and fixed binary headers only); ``tests/service/test_security.py`` guards that.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import grpc

from splitserve.common.errors import Unauthenticated

log = logging.getLogger(__name__)

# Metadata key (gRPC keys are lower case) and scheme of the token.
AUTH_METADATA_KEY = "authorization"
AUTH_SCHEME = "Bearer "
# Services callable without a token: health probes must work from orchestrators.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)
DEFAULT_MAX_MESSAGE_MB = 16
# Derivation label of the KV transport's key (``Security.kv_key``); changing it breaks mixed versions.
KV_KEY_LABEL = b"splitserve kv-tcp key v1"
# Derivation label of the worker registry's signing key (``Security.registry_key``); likewise.
REGISTRY_KEY_LABEL = b"splitserve worker-registry key v1"


def _read(path: str | os.PathLike | bytes | None, flag: str) -> bytes | None:
    """PEM bytes from a path (bytes pass through); None for ''/None."""
    if path is None or path == "":
        return None
    if isinstance(path, bytes):
        return path
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {flag} {os.fspath(path)!r}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {os.fspath(path)!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def read_token_file(path: str) -> list[str]:
    """The tokens of ``--token-file``: one per line; blank lines and lines starting with '#' are skipped."""
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --token-file {path!r}: {e}") from None
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise ValueError(f"--token-file {path!r} holds no token (one per line; '#' starts a comment)")
    return tokens


@dataclass(frozen=True)
class Security:
    """How one process secures its port and the calls it makes. The default is plaintext, open."""

    # PEM certificate chain this process serves with (and presents as a client, for mutual TLS).
    cert: bytes | None = field(default=None, repr=False)
    # PEM private key of ``cert``.
    key: bytes | None = field(default=None, repr=False)
    # PEM CA bundle: a server requires client certs signed by it; a client verifies servers with it.
    ca: bytes | None = field(default=None, repr=False)
    # Bearer token required by the server and sent by the client; '' for none.
    token: str = field(default="", repr=False)
    # Further tokens the server accepts (the gateway: --token-file's and --admin-token); never sent.
    more_tokens: tuple[str, ...] = field(default=(), repr=False)
    # Client side only: use TLS (system roots) even without ``ca`` or ``cert``.
    tls: bool = False
    # Largest message accepted or sent, in bytes.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_MB * 2**20

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both (TLS) or neither (plaintext)")
        for token in (self.token, *self.more_tokens):
            if token and not (token.isascii() and token.isprintable() and token.strip() == token):
                raise ValueError("--auth-token must be printable ASCII without surrounding spaces "
                                 "(it travels as a gRPC metadata value); so must every other token")
        if self.max_message_bytes < 2**10:
            raise ValueError(f"--max-message-mb must be at least 1 (got {self.max_message_bytes} bytes)")

    # ---- construction

    @classmethod
    def load(cls, cert=None, key=None, ca=None, token: str = "", tls: bool = False,
             max_message_mb: float = DEFAULT_MAX_MESSAGE_MB) -> "Security":
        """From PEM file paths (or PEM bytes); raises ValueError naming the flag at fault."""
        if not max_message_mb > 0:
            raise ValueError(f"--max-message-mb must be positive, got {max_message_mb!r}")
        return cls(cert=_read(cert, "--tls-cert"), key=_read(key, "--tls-key"), ca=_read(ca, "--tls-ca"),
                   token=token or "", tls=tls, max_message_bytes=int(max_message_mb * 2**20))

    @classmethod
    def from_args(cls, args) -> "Security":
        """The public side, from the CLI flags (``splitserve.cli.flags``): the gateway's port accepts
        ``--auth-token``, every token of ``--token-file`` and ``--admin-token``. A bad flag exits
        with its message."""
        try:
            more = (*read_token_file(getattr(args, "token_file", "")), getattr(args, "admin_token", ""))
            security = cls.load(args.tls_cert, args.tls_key, args.tls_ca, args.auth_token,
                                max_message_mb=args.max_message_mb)
            return dataclasses.replace(security, more_tokens=tuple(t for t in more if t))
        except ValueError as e:
            raise SystemExit(str(e)) from None

    @classmethod
    def internal_from_args(cls, args) -> "Security":
        """The internal side: a worker's port (accepts only ``--internal-token``) and the gateway's
        calls to workers (send it). Same TLS settings as the public side."""
        try:
            return cls.load(args.tls_cert, args.tls_key, args.tls_ca, getattr(args, "internal_token", ""),
                            max_message_mb=args.max_message_mb)
        except ValueError as e:
            raise SystemExit(str(e)) from None

    @property
    def kv_key(self) -> bytes | None:
        """The secret the workers' tcp KV transport authenticates with (``splitserve/kvtransfer/transports/
        tcp_auth.py``), derived from ``token`` (a worker's ``--internal-token``) so one secret
        secures both the gRPC ports and the KV socket; a separate derivation, so the KV key
        says nothing about the token. None without a token: the KV socket is as open as the port."""
        if not self.token:
            return None
        return hmac.new(self.token.encode(), KV_KEY_LABEL, hashlib.sha256).digest()

    @property
    def registry_key(self) -> bytes | None:
        """The key workers sign their registry record with and gateways verify it with
        (``RedisState(registry_key=...)``), derived from ``token`` (the internal token) like
        ``kv_key``, separately. None without a token: the registry is trusted as Redis is."""
        if not self.token:
            return None
        return hmac.new(self.token.encode(), REGISTRY_KEY_LABEL, hashlib.sha256).digest()

    @property
    def accepted_tokens(self) -> tuple[str, ...]:
        """Every token the server side lets in."""
        return tuple(t for t in (self.token, *self.more_tokens) if t)

    # ---- server side

    @property
    def server_tls(self) -> bool:
        return self.cert is not None

    @property
    def mutual_tls(self) -> bool:
        return self.cert is not None and self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials of the port (client certificates required when a CA is given); None: plaintext."""
        if self.cert is None:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenAuthInterceptor(self.accepted_tokens)] if self.accepted_tokens else []

    def message_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes)]

    # ---- client side

    @property
    def client_tls(self) -> bool:
        return self.tls or self.ca is not None or self.cert is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for calls (verifying with ``ca``, presenting cert/key); None: plaintext."""
        if not self.client_tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to ``address`` as configured: TLS or plaintext, the token on every call;
        ``options``: more channel options (keepalive, retries: ``splitserve.common.grpc_options``)."""
        credentials = credentials or self.channel_credentials()
        options = self.message_options() + list(options)
        channel = (grpc.secure_channel(address, credentials, options=options) if credentials
                   else grpc.insecure_channel(address, options=options))
        if self.token:
            channel = grpc.intercept_channel(channel, _TokenClientInterceptor(self.token))
        return channel

    def aio_channel(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                    options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """The asyncio counterpart of ``channel``."""
        credentials = credentials or self.channel_credentials()
        options = self.message_options() + list(options)
        interceptors = _aio_token_interceptors(self.token) if self.token else None
        if credentials:
            return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


# ---- the token, server side


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` for one of its tokens
    (constant-time comparison with each of them).

    The refusal raises ``splitserve.common.errors.Unauthenticated`` from a handler of the method's own
    kind, so the error-mapping interceptor (placed before this one) turns it into
    ``UNAUTHENTICATED`` with its message. Health checks pass without a token.
    """

    def __init__(self, tokens: str | Sequence[str]) -> None:
        tokens = [tokens] if isinstance(tokens, str) else [t for t in tokens if t]
        if not tokens or not all(tokens):
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        # Compared as sha256 digests: equal lengths, so the time taken says nothing about a token.
        self._expected = [hashlib.sha256((AUTH_SCHEME + t).encode()).digest() for t in tokens]

    def _check(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """None if authorized, else why not."""
        values = [v for k, v in (metadata or ()) if k == AUTH_METADATA_KEY]
        if not values:
            return ("missing credentials: this server requires the metadata 'authorization: Bearer <token>' "
                    "(a token it accepts: the gateway's --auth-token, --token-file or --admin-token; a worker's "
                    "--internal-token)")
        value = values[0] if isinstance(values[0], bytes) else values[0].encode()
        digest = hashlib.sha256(value).digest()
        matched = False
        for expected in self._expected:  # no early exit: the same work whichever token matches
            matched |= hmac.compare_digest(digest, expected)
        if len(values) > 1 or not matched:
            return "invalid credentials: the 'authorization' bearer token is not accepted"
        return None

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        reason = self._check(handler_call_details.invocation_metadata)
        if reason is None:
            return await continuation(handler_call_details)
        log.info("refused %s: %s", method, reason.split(":")[0])
        # Answer with a handler of the method's own kind (a unary handler would wait for a
        # request a bidi client may never send first); unknown methods get the same answer.
        handler = await continuation(handler_call_details)

        async def refuse(request, context):
            raise Unauthenticated(reason)

        async def refuse_stream(request, context):
            raise Unauthenticated(reason)
            yield  # an async generator, as streaming handlers are

        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return grpc.unary_unary_rpc_method_handler(refuse)
        make = {(False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[
            (handler.request_streaming, handler.response_streaming)]
        return make(refuse_stream if handler.response_streaming else refuse)


# ---- the token, client side


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    pass


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call of a sync channel."""

    def __init__(self, token: str) -> None:
        self._pair = (AUTH_METADATA_KEY, AUTH_SCHEME + token)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (d.metadata or ()) if m[0] != AUTH_METADATA_KEY] + [self._pair]
        return _ClientCallDetails(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                                  getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def _aio_token_interceptors(token: str) -> list:
    pair = (AUTH_METADATA_KEY, AUTH_SCHEME + token)

    def details(d):
        metadata = grpc.aio.Metadata(*[m for m in (d.metadata or ()) if m[0] != AUTH_METADATA_KEY], pair)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, client_call_details, request):
            return await continuation(details(client_call_details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, client_call_details, request):
            return await continuation(details(client_call_details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
            return await continuation(details(client_call_details), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
            return await continuation(details(client_call_details), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]
