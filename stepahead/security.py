"""Credentials on the wire: the cluster token of the internal plane, API keys of the public
API, and TLS / mTLS for both (grpc plumbing shared by every daemon and tool).

- Internal plane: every call to the scheduler (AttachWorker, Connect, stats, flight record)
  carries `stepahead-cluster-token: <token>`; a server interceptor refuses anything else
  with UNAUTHENTICATED before the servicer runs, so no worker attaches and no plan is seen
  without it. Health checks stay open (probes carry no credentials).
- Public API: with API keys set, every gateway call carries `authorization: Bearer <key>`.
- TLS: `TLSFiles` names PEM files; with `ca_certs` a server requires client certificates
  (mTLS) and a client verifies the server against it.
Tokens are compared in constant time. Every refusal is handed to the server's `on_reject`
(method and peer address): `Refusals` counts it in a metric and logs it rate-limited, so an
operator sees a probe and a flood of refused calls writes a line per interval, not per call.
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from stepahead import ports
from stepahead.config import ConfigError
from stepahead.config import field as config_field
from stepahead.logs import RateLimitedLog

CLUSTER_TOKEN_HEADER = "stepahead-cluster-token"
API_KEY_HEADER = "authorization"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: a certificate and its key (server, or client for mTLS), and the CA bundle
    that verifies the peer (on a server it turns client certificates on)."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.certfile or self.ca_certs)

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.certfile and self.keyfile):
            raise ValueError("TLS on a server needs both --ssl-certfile and --ssl-keyfile")
        pair = (_read(self.keyfile), _read(self.certfile))
        ca = _read(self.ca_certs) if self.ca_certs else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_certs) if self.ca_certs else None,
            private_key=_read(self.keyfile) if self.keyfile else None,
            certificate_chain=_read(self.certfile) if self.certfile else None,
        )


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def split_keys(value: str | None) -> tuple[str, ...]:
    """`a,b` (`--api-key` or STEPAHEAD_API_KEY) → ("a", "b"); empty parts dropped. Unset (None)
    is no keys; a value given that holds no key (`--api-key "$KEY"` with KEY unset) is a
    ConfigError, not a server that quietly accepts every client."""
    keys = tuple(k.strip() for k in (value or "").split(",") if k.strip())
    if value is not None and not keys:
        raise ConfigError(f"--api-key (or STEPAHEAD_API_KEY): {value!r} holds no key; leave it out to serve "
                          "without API keys")
    return keys


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


# ---- server side ------------------------------------------------------------------------------

def holds_secret(value: str, scheme: str, secrets: Sequence[bytes]) -> bool:
    """Whether a credential header's `value` is `scheme` followed by one of `secrets` (each
    compared in constant time): the one rule of the gRPC interceptors and the HTTP API's check."""
    if not value.startswith(scheme):
        return False
    given = value[len(scheme):].encode()
    return any(hmac.compare_digest(given, s) for s in secrets)


class CredentialInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose `header` does not hold one of `secrets`
    (with `scheme` before it), except methods under `exempt` prefixes; `on_reject(method,
    peer)` is called with each refusal."""

    def __init__(self, header: str, secrets: Iterable[str], *, scheme: str = "", exempt: Sequence[str] = (),
                 what: str = "credential", on_reject: Callable[[str, str], None] = lambda method, peer: None
                 ) -> None:
        self._header, self._scheme = header, scheme
        self._secrets = tuple(s.encode() for s in secrets)
        if not self._secrets:
            raise ValueError(f"no {what} given")
        self._exempt = tuple(exempt)
        self._what = what
        self._on_reject = on_reject

    def _allowed(self, metadata) -> bool:
        return any(key == self._header and isinstance(value, str) and holds_secret(value, self._scheme, self._secrets)
                   for key, value in metadata or ())

    def permits(self, handler_call_details) -> bool:
        method = handler_call_details.method
        return method.startswith(self._exempt) or self._allowed(handler_call_details.invocation_metadata)

    def intercept_service(self, continuation, handler_call_details):
        if self.permits(handler_call_details):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        return None if handler is None else self.refusal(handler, handler_call_details.method)

    def refusal(self, handler: grpc.RpcMethodHandler, method: str, aio: bool = False) -> grpc.RpcMethodHandler:
        """Answer `method` UNAUTHENTICATED instead of `handler`, reporting it to `on_reject`
        (from the refusing call: it knows the peer)."""
        return _refusing(handler, f"missing or wrong {self._what}", aio,
                         lambda context: self._on_reject(method, context.peer()))


class AioCredentialInterceptor(grpc.aio.ServerInterceptor):
    """The same check as `CredentialInterceptor`, for a grpc.aio server."""

    def __init__(self, check: CredentialInterceptor) -> None:
        self._check = check

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self._check.permits(handler_call_details):
            return handler
        return self._check.refusal(handler, handler_call_details.method, aio=True)


def _refusing(handler: grpc.RpcMethodHandler, message: str, aio: bool = False,
              report: Callable[[object], None] = lambda context: None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that calls `report(context)` and refuses
    with UNAUTHENTICATED."""

    def refuse_sync(request, context):
        report(context)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_aio(request, context):
        report(context)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    refuse = refuse_aio if aio else refuse_sync

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=None, response_serializer=None)


class Refusals:
    """What a server does with a refused call: `count(method)` (a metric the daemon owns) and
    a warning `event` at most once per `interval_s` naming the peer, the method and how many
    refusals went unlogged since the previous line."""

    def __init__(self, log, count: Callable[[str], None], event: str, interval_s: float = 10.0) -> None:
        self._count = count
        self._log = RateLimitedLog(log, event, interval_s)

    def __call__(self, method: str, peer: str) -> None:
        self._count(method)
        self._log.note(peer=peer, method=method)


def cluster_interceptor(token: str, on_reject=lambda method, peer: None) -> CredentialInterceptor:
    return CredentialInterceptor(CLUSTER_TOKEN_HEADER, [token], exempt=(HEALTH_PREFIX,), what="cluster token",
                                 on_reject=on_reject)


def api_key_interceptor(keys: Sequence[str], on_reject=lambda method, peer: None) -> CredentialInterceptor:
    return CredentialInterceptor(API_KEY_HEADER, keys, scheme="Bearer ", exempt=(HEALTH_PREFIX,), what="API key",
                                 on_reject=on_reject)


def add_port(server: grpc.Server, host: str, port: int, tls: TLSFiles | None, flag: str) -> int:
    """The port `server` listens on (TLS when `tls` is enabled); ConfigError naming `flag` when
    it cannot bind. The port is checked first (`ports.check_free`: one line before grpc logs
    its own), and the server is made with `ports.EXCLUSIVE_PORT`, so a port another daemon
    holds is refused, not shared."""
    ports.check_free(flag, host, port)
    address = ports.host_port(host, port)
    try:
        if tls is not None and tls.enabled:
            return server.add_secure_port(address, tls.server_credentials())
        return server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address" (taken since the check, or not a local host)
        raise ConfigError(f"{flag}: cannot listen on {address} (another process holds the port, or the host "
                          f"is not this machine's); stop what holds it or pick another {flag}") from None


# ---- client side ------------------------------------------------------------------------------

_Details = collections.namedtuple(
    "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
)


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._pairs = tuple(pairs)

    def _details(self, d):
        metadata = tuple(d.metadata or ()) + self._pairs
        return _Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def credential_metadata(cluster_token: str | None = None, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata that presents the given credentials on a call."""
    pairs = []
    if cluster_token:
        pairs.append((CLUSTER_TOKEN_HEADER, cluster_token))
    if api_key:
        pairs.append((API_KEY_HEADER, f"Bearer {api_key}"))
    return tuple(pairs)


def channel(target: str, *, cluster_token: str | None = None, api_key: str | None = None,
            tls: TLSFiles | None = None, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel that presents the given credentials on every call."""
    base = (grpc.secure_channel(target, tls.channel_credentials(), options=list(options))
            if tls is not None and tls.enabled else grpc.insecure_channel(target, options=list(options)))
    pairs = credential_metadata(cluster_token, api_key)
    return grpc.intercept_channel(base, _AddMetadata(pairs)) if pairs else base


def aio_channel(target: str, *, tls: TLSFiles | None = None,
                options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A `grpc.aio` channel (made on the event loop that will use it). Its calls take their
    credentials as `credential_metadata(...)`: grpc.aio's client interceptors would wrap
    every message of a stream in Python."""
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(target, tls.channel_credentials(), options=list(options))
    return grpc.aio.insecure_channel(target, options=list(options))


@dataclass(frozen=True)
class SchedulerClientConfig:
    """How a daemon (gateway, worker) reaches the scheduler: the config base class both use."""

    cluster_token: str | None = config_field(None, "cluster token the scheduler requires (env recommended)")
    scheduler_ssl_ca_certs: str | None = config_field(None, "CA bundle to verify the scheduler's TLS certificate")
    scheduler_ssl_certfile: str | None = config_field(None, "client certificate for the scheduler (mTLS)")
    scheduler_ssl_keyfile: str | None = config_field(None, "client key for the scheduler (mTLS)")

    def scheduler_channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        return channel(target, cluster_token=self.cluster_token, tls=self._scheduler_tls(), options=options)

    def scheduler_aio_channel(self, target: str) -> grpc.aio.Channel:
        """A `grpc.aio` channel to the scheduler; its calls carry `scheduler_metadata()`."""
        return aio_channel(target, tls=self._scheduler_tls())

    def scheduler_metadata(self) -> tuple[tuple[str, str], ...]:
        return credential_metadata(self.cluster_token)

    def _scheduler_tls(self) -> TLSFiles:
        return TLSFiles(self.scheduler_ssl_certfile, self.scheduler_ssl_keyfile, self.scheduler_ssl_ca_certs)
