"""gRPC helpers every rlfleet service uses: server, channel, TLS, auth, health, errors.

Server side::

    server = create_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer)])
    server.install_signal_handlers()   # SIGTERM/SIGINT: NOT_SERVING, then drain within grace
    print(server.address)              # "127.0.0.1:43215" (port 0 -> a free port)
    server.wait()

Client side::

    channel = create_channel(address, auth_token=token)
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    try:
        stub.Score(request, **call_options(timeout_s=10))
    except grpc.RpcError as e:
        raise to_rlfleet_error(e) from e   # the same class the service raised

What :func:`create_server` sets up, and why:

* **Message size**: send and receive limits of :data:`DEFAULT_MAX_MESSAGE_BYTES`
  (64 MiB). Batches and weights travel chunked well below it (the codec's chunk
  size), so the limit is a guard against runaway messages, not a bound on batch
  size. A message over the limit fails with ``RESOURCE_EXHAUSTED``.
* **Health**: the standard ``grpc.health.v1.Health`` service, ``SERVING`` for ``""``
  and every registered service; :meth:`Server.set_serving` flips one; stopping
  turns every one ``NOT_SERVING`` before the drain starts.
* **Reflection** (``grpc.reflection.v1alpha``) for the registered services, health
  and reflection, so ``grpcurl`` works against any service.
* **Errors** (:class:`ErrorMappingInterceptor`): an :class:`~rlfleet.common.errors.RlfleetError`
  raised by a handler becomes its gRPC status with the message as details, plus a
  serialized ``rlfleet.v1.ErrorInfo`` in the ``rlfleet-error-bin`` trailing
  metadata (read back with :func:`error_info`); any other exception becomes
  ``INTERNAL`` with its type and message, logged with its traceback. Unary and
  streaming handlers alike; the server keeps serving.
* **Auth** (optional): a bearer token checked on every call except health checks,
  which stay open so probes need no secret and reveal only serving status.
  Reflection requires the token, since it reveals the API surface.
* **TLS / mTLS** (optional): :class:`TLSConfig`.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import json
import logging
import os
import signal
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn, TypeVar, cast

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlfleet.common import auth, tracing
from rlfleet.common.auth import Authenticator, Credentials
from rlfleet.common.errors import (
    Internal,
    InvalidArgument,
    PermissionDenied,
    RlfleetError,
    Unauthenticated,
    Unavailable,
    error_class_for_status,
)
from rlfleet.v1 import common_pb2

__all__ = [
    "AUTH_METADATA_KEY",
    "DEFAULT_GRACE_S",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TIMEOUT_S",
    "ERROR_INFO_KEY",
    "HEALTH_SERVICE",
    "REFLECTION_SERVICE",
    "BearerTokenInterceptor",
    "ErrorMappingInterceptor",
    "Registration",
    "Security",
    "Server",
    "TLSConfig",
    "Watchdog",
    "add_security_arguments",
    "add_service",
    "call_options",
    "check_health",
    "client_security_from_env",
    "create_channel",
    "create_server",
    "current_security",
    "error_info",
    "grpc_method",
    "health_probe",
    "init_service_security",
    "is_loopback",
    "port_taken",
    "security_from_args",
    "set_security",
    "taken_ports",
    "tls_from_env",
    "to_rlfleet_error",
    "using_security",
    "wait_for_ready",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Send/receive limit on both ends: 64 MiB, above any chunk the codec produces."""

DEFAULT_TIMEOUT_S = 30.0
"""Per-call deadline clients use when the caller gives none (see :func:`call_options`)."""

DEFAULT_GRACE_S = 10.0
"""How long in-flight calls may run on after a stop before they are cancelled."""

ERROR_INFO_KEY = "rlfleet-error-bin"
"""Trailing metadata key carrying a serialized ``rlfleet.v1.ErrorInfo``."""

AUTH_METADATA_KEY = "authorization"
"""Metadata key of the bearer token (``authorization: Bearer <token>``)."""

HEALTH_SERVICE: str = health.SERVICE_NAME
"""``grpc.health.v1.Health``: open even when a bearer token is required."""

REFLECTION_SERVICE: str = reflection.SERVICE_NAME
"""``grpc.reflection.v1alpha.ServerReflection``."""

# Methods that stay open when a bearer token is required.
_OPEN_METHOD_PREFIXES = (f"/{HEALTH_SERVICE}/",)
# Infrastructure methods whose handlers are left alone by the error mapping
# (health's Watch uses a non-blocking handler signature that must not be wrapped).
_INFRA_METHOD_PREFIXES = (f"/{HEALTH_SERVICE}/", f"/{REFLECTION_SERVICE}/")

# Status details and metadata share the client's 8 KiB default metadata limit;
# keep the error well below it whatever the handler put in the message.
_MAX_DETAILS_CHARS = 2048
_MAX_VALUE_CHARS = 512
_MAX_FIELD_CHARS = 256

# Keepalive: clients ping an idle connection every 30 s and drop it after 10 s
# without an answer; servers accept pings that often (the gRPC default would
# answer them with GOAWAY "too_many_pings").
_KEEPALIVE_TIME_MS = 30_000
_KEEPALIVE_TIMEOUT_MS = 10_000
_MIN_PING_INTERVAL_MS = 10_000
_RECONNECT_BACKOFF_MS = (100, 1_000)  # first, most

Registration = tuple[Callable[[Any, Any], None], object]
"""``(add_XServicer_to_server, servicer)``, as generated in ``rlfleet.v1.*_pb2_grpc``."""

_F = TypeVar("_F", bound=Callable[..., Any])


# --------------------------------------------------------------------------- TLS


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """TLS material, for a server or a client (PEM file paths).

    Server: ``cert``/``key`` are the server's; ``ca`` verifies client certificates
    and is required when ``require_client_cert`` (mTLS).
    Client: ``ca`` is the root that verifies the server (``None``: the system
    roots); ``cert``/``key`` are the client's certificate for mTLS.

    Attributes:
        cert: certificate chain (PEM).
        key: private key of ``cert`` (PEM).
        ca: CA bundle (PEM).
        require_client_cert: server only: refuse clients without a certificate
            signed by ``ca``.
        server_name_override: client only: the name to verify the server's
            certificate against instead of the address's host (tests, IP addresses).
    """

    cert: str | Path | None = None
    key: str | Path | None = None
    ca: str | Path | None = None
    require_client_cert: bool = False
    server_name_override: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """``grpc.ssl_server_credentials`` from the files; checks what mTLS needs."""
        if self.cert is None or self.key is None:
            raise ValueError(
                f"TLSConfig for a server needs cert and key, got cert={self.cert!r} "
                f"key={self.key!r}"
            )
        if self.require_client_cert and self.ca is None:
            raise ValueError("TLSConfig.require_client_cert=True needs ca to verify clients")
        root = _read(self.ca) if self.ca is not None else None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=root,
            require_client_auth=self.require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """``grpc.ssl_channel_credentials`` from the files."""
        if (self.cert is None) != (self.key is None):
            raise ValueError(
                f"TLSConfig client certificate needs both cert and key, got "
                f"cert={self.cert!r} key={self.key!r}"
            )
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca is not None else None,
            private_key=_read(self.key) if self.key is not None else None,
            certificate_chain=_read(self.cert) if self.cert is not None else None,
        )

    def ssl_server_context(self) -> ssl.SSLContext:
        """A ``ssl`` server context from the files (TLS 1.2 at least; client
        certificates verified against ``ca``, and required when
        ``require_client_cert``), for the endpoints that are not gRPC: the HTTP pages
        and the bulk weight plane's TCP listeners."""
        if self.cert is None or self.key is None:
            raise ValueError(
                f"TLSConfig for a server needs cert and key, got cert={self.cert!r} "
                f"key={self.key!r}"
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.cert), str(self.key))
        if self.ca is not None:
            ctx.load_verify_locations(str(self.ca))
        if self.require_client_cert:
            if self.ca is None:
                raise ValueError("TLSConfig.require_client_cert=True needs ca to verify clients")
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def ssl_client_context(self) -> ssl.SSLContext:
        """A ``ssl`` client context from the files: the server verified against ``ca``
        (the system roots without it) and its name, this side's certificate presented
        when it has one (mTLS). Connect with :meth:`server_name` as the host name."""
        if (self.cert is None) != (self.key is None):
            raise ValueError(
                f"TLSConfig client certificate needs both cert and key, got "
                f"cert={self.cert!r} key={self.key!r}"
            )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is not None:
            ctx.load_verify_locations(str(self.ca))
        else:
            ctx.load_default_certs()
        if self.cert is not None and self.key is not None:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def server_name(self, host: str) -> str:
        """The name a client verifies the server at ``host`` against."""
        return self.server_name_override or host


def _read(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read TLS file {str(path)!r}: {e}") from e


# ------------------------------------------------------------ errors at the boundary


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + "...[truncated]"


def _to_error_info(err: RlfleetError) -> common_pb2.ErrorInfo:
    return common_pb2.ErrorInfo(
        code=err.code,
        field=_clip(err.field, _MAX_FIELD_CHARS),
        value=_clip(err.value_text, _MAX_VALUE_CHARS),
        sample_index=-1 if err.sample_index is None else err.sample_index,
        message=_clip(str(err), _MAX_DETAILS_CHARS),
        recoverable=err.recoverable,
    )


def _abort_for(exc: Exception, context: grpc.ServicerContext, where: str) -> None:
    """Abort the call for ``exc`` (raises), or return when the caller should re-raise.

    Re-raise (return) when the call already has its status, e.g. the exception
    is the one ``context.abort`` raises, or when the client is gone.
    """
    code = context.code()
    if code is not None and code != grpc.StatusCode.OK:
        return
    if isinstance(exc, grpc.RpcError) and not context.is_active():
        return  # cancelled or past its deadline: nobody to tell
    if isinstance(exc, RlfleetError):
        err = exc
        if isinstance(exc, Internal):
            logger.error("%s failed: %s", where, exc, exc_info=exc)
        else:
            logger.info("%s failed: %s: %s", where, exc.status, exc)
    else:
        err = Internal(f"{type(exc).__name__}: {exc}")
        logger.error("%s raised an unexpected exception", where, exc_info=exc)
    trailing = tuple(context.trailing_metadata() or ())
    context.set_trailing_metadata(
        (*trailing, (ERROR_INFO_KEY, _to_error_info(err).SerializeToString()))
    )
    context.abort(grpc.StatusCode[err.status], _clip(str(err), _MAX_DETAILS_CHARS))


def _guard_iterator(
    iterator: Iterable[Any], context: grpc.ServicerContext, where: str
) -> Iterator[Any]:
    try:
        yield from iterator
    except Exception as exc:
        _abort_for(exc, context, where)
        raise


def _mapped(behavior: Callable[..., Any], where: str) -> Callable[..., Any]:
    """Wrap a handler ``(request_or_iterator, context) -> response_or_iterator``."""

    @functools.wraps(behavior)
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            if isinstance(request, Iterator):
                request = _checked_requests(request)
            else:
                request = _refuse_malformed(request)
            result = behavior(request, context)
        except Exception as exc:
            _abort_for(exc, context, where)
            raise
        if isinstance(result, Iterator):  # a streaming response: guard its iteration too
            return _guard_iterator(result, context, where)
        return result

    return call


def grpc_method(method: _F) -> _F:
    """Decorate a servicer method so errors map to status codes as in :class:`ErrorMappingInterceptor`.

    Only needed on servers not built by :func:`create_server` (which installs the
    interceptor); harmless on those. Works for unary methods and for methods that
    return or yield a stream.
    """
    where = method.__qualname__

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        return _mapped(functools.partial(method, self), where)(request, context)

    return cast(_F, wrapper)


@dataclasses.dataclass(frozen=True)
class _Malformed:
    """What a request that failed to parse becomes, so the handler can refuse it."""

    error: str


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, ValueError, TypeError) as e:
            return _Malformed(f"{type(e).__name__}: {e}")

    return parse


def _refuse_malformed(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise InvalidArgument(
            f"the request is not a valid protobuf message ({request.error})",
            field="request",
            value=request.error,
        )
    return request


def _checked_requests(requests: Iterable[Any]) -> Iterator[Any]:
    for request in requests:
        yield _refuse_malformed(request)


def _rebuild_handler(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    *,
    lenient: bool = False,
) -> grpc.RpcMethodHandler:
    """The same kind of handler with its behavior replaced by ``wrap(behavior)``.

    ``lenient``: requests that fail to parse reach the behavior as :class:`_Malformed`
    (and :func:`_mapped` refuses them with INVALID_ARGUMENT) instead of failing in
    gRPC's deserializer with INTERNAL.
    """
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for attr, factory in kinds:
        behavior = getattr(handler, attr)
        if behavior is not None:
            return factory(
                wrap(behavior),
                request_deserializer=(
                    _lenient(handler.request_deserializer)
                    if lenient
                    else handler.request_deserializer
                ),
                response_serializer=handler.response_serializer,
            )
    raise ValueError(f"method handler {handler!r} has no behavior")


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Server interceptor mapping exceptions of every handler to gRPC statuses.

    ``RlfleetError`` -> ``grpc.StatusCode[err.status]``, details ``str(err)``, and
    ``ErrorInfo`` in the ``rlfleet-error-bin`` trailing metadata; any other
    ``Exception`` -> ``INTERNAL`` ``"<Type>: <message>"``, logged with traceback.
    Calls already aborted with ``context.abort`` keep their status.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(_INFRA_METHOD_PREFIXES):
            return handler
        return _rebuild_handler(handler, lambda behavior: _mapped(behavior, method), lenient=True)


def error_info(error: grpc.RpcError) -> common_pb2.ErrorInfo | None:
    """The ``ErrorInfo`` a failed call carried in its trailing metadata, if any."""
    trailing = getattr(error, "trailing_metadata", None)
    if trailing is None:
        return None
    for key, value in trailing() or ():
        if key == ERROR_INFO_KEY:
            try:
                info: common_pb2.ErrorInfo = common_pb2.ErrorInfo.FromString(value)
            except DecodeError as e:
                logger.warning("unreadable %s trailing metadata (%d bytes): %s", key, len(value), e)
                return None
            return info
    return None


def to_rlfleet_error(error: grpc.RpcError) -> RlfleetError:
    """The :class:`RlfleetError` a failed call stands for, to re-raise client-side.

    With an ``ErrorInfo``, the class matching the status code with all its fields;
    without (transport errors, other servers), the class matching the status code
    (``Internal`` when none does) with the status details as the message.
    """
    code_fn = getattr(error, "code", None)
    code: grpc.StatusCode = code_fn() if code_fn is not None else grpc.StatusCode.UNKNOWN
    cls = error_class_for_status(code.name)
    info = error_info(error)
    if info is not None:
        prefix = f"{info.field}: "
        message = info.message
        if info.field and message.startswith(prefix):
            message = message[len(prefix) :]
        return cls(
            message,
            field=info.field,
            value=info.value or None,
            sample_index=None if info.sample_index < 0 else info.sample_index,
            code=info.code or None,
            recoverable=info.recoverable,
        )
    details_fn = getattr(error, "details", None)
    details = (details_fn() if details_fn is not None else None) or str(error)
    return cls(f"{code.name}: {details}", code=code.name)


# -------------------------------------------------------------------------- auth


def _check_token(token: str) -> str:
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError("auth token must be non-empty printable ASCII without spaces")
    return token


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Server interceptor: authenticate every call by its bearer token, then authorize it.

    ``authorization: Bearer <token>`` must appear exactly once and name a role the
    :class:`~rlfleet.common.auth.Authenticator` knows (``UNAUTHENTICATED``
    otherwise, compared in constant time); that role must be allowed the method by
    :func:`rlfleet.common.auth.allowed` (``PERMISSION_DENIED`` otherwise). The
    handler runs with the role in :func:`rlfleet.common.auth.caller_role`.
    Health checks are exempt (see module docstring).

    Args:
        auth: an authenticator, or one shared token (whoever holds it is ``admin``).
    """

    def __init__(self, auth: Authenticator | str) -> None:
        if isinstance(auth, str):
            auth = Credentials.shared(_check_token(auth)).authenticator()
        self._auth = auth

    def _role(
        self, metadata: Iterable[tuple[str, Any]] | None, method: str
    ) -> tuple[str | None, str]:
        """``(role, "")`` when authenticated, else ``(None, why not)``."""
        values = [value for key, value in metadata or () if key == AUTH_METADATA_KEY]
        if not values:
            return None, f"missing '{AUTH_METADATA_KEY}' metadata"
        if len(values) > 1:
            return None, f"{len(values)} '{AUTH_METADATA_KEY}' metadata entries, expected 1"
        value = values[0]
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if not raw.startswith(b"Bearer ") or len(raw) > 512:
            return None, "invalid bearer token"
        role = self._auth.role_of(raw[len(b"Bearer ") :], auth.method_audience(method))
        if role is None:
            return None, "invalid bearer token"
        return role, ""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        if method.startswith(_OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        role, reason = self._role(handler_call_details.invocation_metadata, method)
        handler = continuation(handler_call_details)
        if role is not None and auth.allowed(role, method):
            if handler is None:
                return None
            return _rebuild_handler(handler, lambda behavior: _as_caller(behavior, role))
        # Deny with a handler of the same kind; unknown methods are denied too, so
        # an unauthenticated caller cannot probe which methods exist.
        denied: RlfleetError
        if role is None:
            denied = Unauthenticated(f"{method}: {reason}")
        else:
            denied = PermissionDenied(
                f"{method}: role {role!r} may not call this method", field="role", value=role
            )
            logger.warning("refused %s to role %s", method, role)

        def deny(_request: Any, context: grpc.ServicerContext) -> NoReturn:
            _abort_for(denied, context, method)
            raise denied  # unreachable: _abort_for aborts

        if handler is None:
            return grpc.unary_unary_rpc_method_handler(deny)
        return _rebuild_handler(handler, lambda _behavior: deny, lenient=True)


class TraceInterceptor(grpc.ServerInterceptor):
    """Runs each handler (and its response stream) inside the caller's trace span, read
    from the ``rlfleet-trace`` metadata entry (or, without it, a W3C ``traceparent``
    that an OpenTelemetry-instrumented caller sends), so the service's spans join the
    caller's trace (:mod:`rlfleet.common.tracing`). A malformed entry is ignored."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        ours = theirs = None  # rlfleet's entry wins over a W3C traceparent
        for key, v in handler_call_details.invocation_metadata or ():
            if key == tracing.TRACE_METADATA_KEY:
                ours = v
            elif key == tracing.TRACEPARENT_KEY:
                theirs = v
        ctx = tracing.from_header(ours) or tracing.from_header(theirs)
        if handler is None or ctx is None:
            return handler
        return _rebuild_handler(handler, lambda behavior: _in_trace(behavior, ctx))


def _in_trace(behavior: Callable[..., Any], ctx: tracing.SpanContext) -> Callable[..., Any]:
    @functools.wraps(behavior)
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        with tracing.attached(ctx):
            result = behavior(request, context)
        if isinstance(result, Iterator):
            return _iterate_in(result, ctx)
        return result

    return call


def _iterate_in(iterator: Iterator[Any], ctx: tracing.SpanContext) -> Iterator[Any]:
    while True:
        with tracing.attached(ctx):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


def _as_caller(behavior: Callable[..., Any], role: str) -> Callable[..., Any]:
    """Run a handler (and iterate its response stream) with ``caller_role() == role``."""

    @functools.wraps(behavior)
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        with auth.using_caller(role):
            result = behavior(request, context)
        if isinstance(result, Iterator):
            return _iterate_as(result, role)
        return result

    return call


def _iterate_as(iterator: Iterator[Any], role: str) -> Iterator[Any]:
    while True:
        with auth.using_caller(role):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


@dataclasses.dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str | bytes]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _BearerTokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token for the service called>`` (with a token)
    and the current trace span (``rlfleet-trace``, :mod:`rlfleet.common.tracing`) to
    every call of a channel.

    The token sent is :func:`rlfleet.common.auth.audience_token` of the service the
    method belongs to, never the token itself: whoever answers at the address (a
    fake replica the registry lists, say) learns a token good for that service's
    methods only. Calls outside :data:`~rlfleet.common.auth.AUDIENCES` (health
    checks, which need none) carry no token.

    An interceptor rather than call credentials: gRPC only sends call
    credentials over TLS, and loopback services run in plaintext.
    """

    def __init__(self, token: str | None) -> None:
        self._token = _check_token(token) if token is not None else None
        self._headers: dict[str, tuple[str, str] | None] = {}

    def _header(self, method: str) -> tuple[str, str] | None:
        audience = auth.method_audience(method)
        header = self._headers.get(audience or "")
        if header is None and self._token is not None and audience is not None:
            token = auth.audience_token(self._token, audience)
            header = self._headers[audience] = (AUTH_METADATA_KEY, f"Bearer {token}")
        return header

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        # What this interceptor sets replaces what the call carries; the rest (a token
        # given per call on a channel without one, say) passes as it is.
        trace = tracing.header()
        header = self._header(details.method)
        drop = set()
        if self._token is not None:
            drop.add(AUTH_METADATA_KEY)
        if trace is not None:
            drop |= {tracing.TRACE_METADATA_KEY, tracing.TRACEPARENT_KEY}
        metadata = [(k, v) for k, v in details.metadata or () if k not in drop]
        if header is not None:
            metadata.append(header)
        if trace is not None:
            metadata.append((tracing.TRACE_METADATA_KEY, trace))
            metadata.append((tracing.TRACEPARENT_KEY, f"00-{trace}-01"))  # tracing.traceparent()
        return _CallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=getattr(details, "wait_for_ready", None),
            compression=getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


# ---------------------------------------------------------------------- security


@dataclasses.dataclass(frozen=True)
class Security:
    """How a process authenticates: its credentials, its TLS material, or neither.

    Servers built by :func:`create_server` and channels from :func:`create_channel`
    use the process's security (:func:`set_security`, :func:`using_security`) when
    they are given no ``auth_token``/``tls`` of their own.

    Attributes:
        credentials: this process's role and token, and who may call it; None only
            when ``insecure``.
        tls: TLS material (PEM paths): ``cert``/``key`` are served by servers and,
            for mTLS, presented by clients; ``ca`` verifies the peer.
        insecure: authentication explicitly turned off (``--insecure``).
    """

    credentials: Credentials | None = None
    tls: TLSConfig | None = None
    insecure: bool = False

    @property
    def role(self) -> str | None:
        return self.credentials.role if self.credentials is not None else None

    def server_tls(self) -> TLSConfig | None:
        return self.tls if self.tls is not None and self.tls.cert is not None else None

    def client_tls(self) -> TLSConfig | None:
        """What a client of this process dials with: the CA, and the cert for mTLS."""
        if self.tls is None:
            return None
        return TLSConfig(
            cert=self.tls.cert,
            key=self.tls.key,
            ca=self.tls.ca,
            server_name_override=self.tls.server_name_override,
        )

    def tls_env(self) -> dict[str, str]:
        """Environment handing the TLS material to a child process."""
        if self.tls is None:
            return {}
        env = {
            auth.TLS_ENV[k]: str(v)
            for k, v in (("cert", self.tls.cert), ("key", self.tls.key), ("ca", self.tls.ca))
            if v is not None
        }
        if self.tls.require_client_cert:
            env[auth.TLS_ENV["require_client_cert"]] = "1"
        if self.tls.server_name_override:
            env[auth.TLS_ENV["server_name"]] = self.tls.server_name_override
        return env

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        insecure: bool = False,
        what: str = "service",
    ) -> Security:
        """This process's security from its environment (see :mod:`rlfleet.common.auth`).

        Raises:
            CredentialError: no credentials and not ``insecure`` (nor ``RLFLEET_INSECURE=1``),
                or credentials / TLS variables that are set but unusable.
        """
        env = os.environ if env is None else env
        tls = tls_from_env(env)
        insecure = insecure or env.get(auth.INSECURE_ENV, "") in ("1", "true", "yes")
        if insecure:
            logger.warning(
                "%s: AUTHENTICATION IS OFF (--insecure): anyone who reaches its ports can "
                "call every method, push weights and read the model",
                what,
            )
            return cls(credentials=None, tls=tls, insecure=True)
        creds = auth.load_credentials(env)
        if creds is None:
            raise auth.CredentialError(
                f"{what}: no credentials: set {auth.CREDENTIALS_ENV} to this role's file from "
                f"`rlfleet secrets init --dir DIR` (or {auth.CREDENTIALS_JSON_ENV}, or a shared "
                f"token in {auth.SHARED_TOKEN_ENV}), or pass --insecure to run without "
                "authentication"
            )
        return cls(credentials=creds, tls=tls)


def tls_from_env(env: Mapping[str, str]) -> TLSConfig | None:
    """TLS material named by ``RLFLEET_TLS_CERT``/``_KEY``/``_CA`` (None when none is set)."""
    cert, key, ca = (env.get(auth.TLS_ENV[k]) or None for k in ("cert", "key", "ca"))
    if cert is None and key is None and ca is None:
        return None
    if (cert is None) != (key is None):
        raise auth.CredentialError(
            f"{auth.TLS_ENV['cert']} and {auth.TLS_ENV['key']} go together, got "
            f"cert={cert!r} key={key!r}"
        )
    for name, path in (("cert", cert), ("key", key), ("ca", ca)):
        if path is not None and not Path(path).is_file():
            raise auth.CredentialError(f"{auth.TLS_ENV[name]}={path}: no such file")
    require = env.get(auth.TLS_ENV["require_client_cert"], "") in ("1", "true", "yes")
    if require and ca is None:
        raise auth.CredentialError(
            f"{auth.TLS_ENV['require_client_cert']}=1 needs {auth.TLS_ENV['ca']}"
        )
    server_name = env.get(auth.TLS_ENV["server_name"]) or None
    return TLSConfig(
        cert=cert, key=key, ca=ca, require_client_cert=require, server_name_override=server_name
    )


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (None: it can, or ``port`` is 0)."""
    if not port:
        return None
    import socket

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as s:
        # As the gRPC and HTTP servers bind: connections of a process that just died
        # (TIME_WAIT) do not hold the port, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def taken_ports(host: str, ports: Mapping[str, int | None]) -> list[str]:
    """One line per flag (``--port``, ...) whose port on ``host`` is taken: checked at a
    service's start, before it loads anything."""
    out = []
    for flag, port in ports.items():
        if port is None or port <= 0:
            continue  # 0: any free port; negative: off
        why = port_taken(host, port)
        if why is not None:
            out.append(f"{flag} {port}: cannot be bound on {host}: {why}")
    return out


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def init_service_security(args: Any, *, what: str, host: str) -> Security:
    """A service process's security from its flags and environment, made process-wide.

    Raises:
        CredentialError: no credentials and no ``--insecure``; unusable credentials or
            TLS files; or ``--insecure`` with a ``host`` beyond loopback (services
            leave loopback only with authentication on).
    """
    security = security_from_args(args, what=what)
    if security.insecure and not is_loopback(host):
        raise auth.CredentialError(
            f"{what}: --insecure is refused on {host}: a service listens beyond loopback "
            "only with authentication on"
        )
    set_security(security)
    if security.credentials is not None:
        logger.info(
            "%s: authentication on (role %s, credentials from %s)%s",
            what,
            security.credentials.role,
            security.credentials.source,
            ", TLS" if security.server_tls() is not None else "",
        )
    return security


def client_security_from_env(env: Mapping[str, str] | None = None) -> Security | None:
    """A client command's security: the credentials and TLS its environment names
    (``RLFLEET_CREDENTIALS`` ..., ``RLFLEET_TLS_*``), or None when it names none."""
    env = os.environ if env is None else env
    creds = auth.load_credentials(env)
    tls = tls_from_env(env)
    if creds is None and tls is None:
        return None
    return Security(credentials=creds, tls=tls, insecure=creds is None)


_SECURITY: Security | None = None
_SECURITY_LOCK = threading.Lock()


def set_security(security: Security | None) -> None:
    """Make ``security`` this process's default for servers and channels."""
    global _SECURITY
    with _SECURITY_LOCK:
        _SECURITY = security


def current_security() -> Security | None:
    """The process's default security (None: nothing configured, plaintext and open)."""
    return _SECURITY


@contextlib.contextmanager
def using_security(security: Security | None) -> Iterator[Security | None]:
    """Set the process's default security for a block, restoring the previous one."""
    previous = _SECURITY
    set_security(security)
    try:
        yield security
    finally:
        set_security(previous)


def add_security_arguments(parser: Any) -> None:
    """``--insecure`` and ``--tls-cert/--tls-key/--tls-ca/--tls-require-client-cert/
    --tls-server-name``.

    Credentials themselves never come from argv (``ps`` shows it): see
    :mod:`rlfleet.common.auth`.
    """
    group = parser.add_argument_group("security")
    group.add_argument(
        "--insecure",
        action="store_true",
        help="run WITHOUT authentication (also RLFLEET_INSECURE=1); loopback tests only",
    )
    group.add_argument("--tls-cert", default=None, help="certificate (PEM); also $RLFLEET_TLS_CERT")
    group.add_argument("--tls-key", default=None, help="its private key; also $RLFLEET_TLS_KEY")
    group.add_argument("--tls-ca", default=None, help="CA verifying peers; also $RLFLEET_TLS_CA")
    group.add_argument(
        "--tls-require-client-cert",
        action="store_true",
        help="mTLS: refuse clients without a certificate from --tls-ca",
    )
    group.add_argument(
        "--tls-server-name",
        default=None,
        help="the name this process's calls check the peers' certificates against, "
        "instead of their host; also $RLFLEET_TLS_SERVER_NAME",
    )


def security_from_args(args: Any, *, what: str) -> Security:
    """:meth:`Security.from_env` with the flags of :func:`add_security_arguments` on top."""
    env = dict(os.environ)
    for name in ("cert", "key", "ca", "server_name"):
        value = getattr(args, f"tls_{name}", None)
        if value:
            env[auth.TLS_ENV[name]] = value
    if getattr(args, "tls_require_client_cert", False):
        env[auth.TLS_ENV["require_client_cert"]] = "1"
    return Security.from_env(env, insecure=bool(getattr(args, "insecure", False)), what=what)


# ------------------------------------------------------------------------ server


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _RecordingServer:
    """Passes registrations through to a ``grpc.Server``, noting the service names."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server
        self.service_names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        handlers = tuple(handlers)
        for handler in handlers:
            name = getattr(handler, "service_name", None)
            if callable(name):
                self.service_names.append(name())
        self._server.add_generic_rpc_handlers(handlers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class Server:
    """A started gRPC server with health, reflection and graceful shutdown.

    Built by :func:`create_server`; wraps (does not subclass) ``grpc.Server``,
    reachable as :attr:`grpc_server`.
    """

    def __init__(
        self,
        server: grpc.Server,
        *,
        host: str,
        port: int,
        health_servicer: health.HealthServicer,
        service_names: Sequence[str],
    ) -> None:
        self.grpc_server = server
        self.host = host
        self.port = port
        self.service_names = tuple(service_names)
        self._health = health_servicer
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()

    @property
    def address(self) -> str:
        """``"host:port"`` to give :func:`create_channel` (``[host]:port`` for IPv6)."""
        return _format_address(self.host, self.port)

    def set_serving(self, service: str, serving: bool) -> None:
        """Report ``service`` (``""`` = the whole server) SERVING or NOT_SERVING.

        Ignored once the server is stopping (everything is NOT_SERVING then).
        """
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self._health.set(service, status)

    def _begin_stop(self, grace_s: float) -> threading.Event:
        with self._stop_lock:
            if not self._stopping.is_set():
                self._stopping.set()
                logger.info("server %s stopping (grace %.1fs)", self.address, grace_s)
                # Health first, so watchers and balancers see NOT_SERVING before
                # the listener closes.
                self._health.enter_graceful_shutdown()
            event: threading.Event = self.grpc_server.stop(grace_s)
            return event

    def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Stop gracefully and block until done.

        Health goes NOT_SERVING, new calls are refused at once, in-flight calls may
        finish for up to ``grace_s`` seconds and are cancelled after. Idempotent;
        a second call with a shorter grace shortens it.
        """
        self._begin_stop(grace_s).wait()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server has stopped (or ``timeout_s`` passed); True if stopped."""
        timed_out: bool = self.grpc_server.wait_for_termination(timeout_s)
        return not timed_out

    def install_signal_handlers(
        self,
        grace_s: float = DEFAULT_GRACE_S,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
    ) -> None:
        """Make ``signals`` stop the server gracefully; a second signal stops it at once.

        Must be called from the main thread. The stop runs on a helper thread (no
        locks taken inside the signal handler); :meth:`wait` returns when it is done.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_signal_handlers must be called from the main thread")

        def handle(signum: int, _frame: FrameType | None) -> None:
            grace = 0.0 if self._stopping.is_set() else grace_s
            name = signal.Signals(signum).name
            threading.Thread(
                target=self._stop_on_signal, args=(name, grace), name="rlfleet-stop", daemon=True
            ).start()

        for sig in signals:
            signal.signal(sig, handle)

    def _stop_on_signal(self, name: str, grace_s: float) -> None:
        logger.info("server %s got %s", self.address, name)
        self._begin_stop(grace_s)

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(grace_s=0.0 if exc is not None else DEFAULT_GRACE_S)


def add_service(
    server: Any,
    service: Any,
    servicer: Any,
    *,
    parsers: Mapping[str, Callable[[bytes], Any]] | None = None,
    serializers: Mapping[str, Callable[[Any], bytes]] | None = None,
) -> None:
    """Register ``servicer`` for ``service`` (a protobuf ``ServiceDescriptor``) as
    the generated ``add_XServicer_to_server`` would, except that the messages named
    in ``parsers`` (request types, by full name) and ``serializers`` (response
    types) go through the given functions instead of protobuf's: a chunk stream is
    parsed without copying its tensor bytes, and answers already serialized pass
    through."""
    from google.protobuf import symbol_database

    db = symbol_database.Default()
    parsers = parsers or {}
    serializers = serializers or {}
    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for m in service.methods:
        in_name, out_name = m.input_type.full_name, m.output_type.full_name
        parse = parsers.get(in_name) or db.GetSymbol(in_name).FromString
        serialize = serializers.get(out_name) or db.GetSymbol(out_name).SerializeToString
        handlers[m.name] = factories[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name), request_deserializer=parse, response_serializer=serialize
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def create_server(
    registrations: Iterable[Registration],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    max_concurrent_rpcs: int | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: TLSConfig | None = None,
    auth_token: str | None = None,
    service_names: Sequence[str] = (),
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    map_errors: bool = True,
    serving: bool = True,
    options: Sequence[tuple[str, Any]] = (),
    reuse_port: bool = False,
    security: Security | None = None,
) -> Server:
    """Build, bind and start a thread-pool gRPC server.

    Args:
        registrations: ``(add_XServicer_to_server, servicer)`` pairs.
        host: interface to bind; loopback by default, ``"0.0.0.0"`` to expose.
        port: port to bind; 0 picks a free one (read it from ``server.port``).
            Binding a busy port fails, unless ``reuse_port``.
        max_workers: handler threads; a streaming call holds one for its duration.
        max_concurrent_rpcs: calls beyond this fail with RESOURCE_EXHAUSTED (None: no cap).
        max_message_bytes: send and receive limit per message.
        tls: serve TLS (mTLS with ``tls.require_client_cert``); None: the
            security's (below), else plaintext.
        auth_token: require ``authorization: Bearer <auth_token>`` (health exempt);
            None: the security's credentials, else no authentication.
        security: the credentials and TLS to serve with; None: the process's
            (:func:`current_security`).
        service_names: extra service names for health and reflection, beyond those
            the registrations register (found automatically).
        interceptors: more server interceptors, run after auth and error mapping.
        map_errors: install :class:`ErrorMappingInterceptor`.
        serving: initial health status of ``""`` and every service; pass False and
            call ``set_serving`` once the service is ready (e.g. model loaded).
        options: more ``grpc.server`` channel arguments.
        reuse_port: set ``SO_REUSEPORT``, so several processes (each with a server
            of its own, created after any fork) listen on one port and the kernel
            spreads connections over them. Off by default, so that a second server
            on a busy port fails instead of silently taking half its connections.

    Returns:
        The started :class:`Server`.
    """
    security = security if security is not None else current_security()
    authenticator: Authenticator | str | None = auth_token
    if security is not None:
        if authenticator is None and security.credentials is not None:
            authenticator = security.credentials.authenticator()
        if tls is None:
            tls = security.server_tls()
    all_interceptors: list[grpc.ServerInterceptor] = []
    if authenticator is not None:
        all_interceptors.append(BearerTokenInterceptor(authenticator))
    if map_errors:
        all_interceptors.append(ErrorMappingInterceptor())
    all_interceptors.append(TraceInterceptor())
    all_interceptors.extend(interceptors)
    server_options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        *options,
    ]
    grpc_server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rlfleet-grpc"),
        interceptors=all_interceptors,
        options=server_options,
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    recorder = _RecordingServer(grpc_server)
    for add_to_server, servicer in registrations:
        add_to_server(servicer, recorder)
    names = list(dict.fromkeys([*recorder.service_names, *service_names]))

    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", *names):
        health_servicer.set(name, status)
    reflection.enable_server_reflection((*names, HEALTH_SERVICE, REFLECTION_SERVICE), grpc_server)

    address = _format_address(host, port)
    try:
        if tls is not None:
            bound = grpc_server.add_secure_port(address, tls.server_credentials())
        else:
            bound = grpc_server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot bind gRPC server to {address}: {e}") from e
    if not bound:
        raise OSError(f"cannot bind gRPC server to {address}")
    grpc_server.start()
    logger.info(
        "serving %s on %s (%s%s)",
        ", ".join(names) or "no services",
        _format_address(host, bound),
        ("mtls" if tls.require_client_cert else "tls") if tls is not None else "plaintext",
        ", token auth" if authenticator is not None else ", NO AUTH",
    )
    return Server(
        grpc_server, host=host, port=bound, health_servicer=health_servicer, service_names=names
    )


# ------------------------------------------------------------------------ client


def _service_config(
    *,
    retry_unavailable: bool,
    max_attempts: int,
    initial_backoff_s: float,
    max_backoff_s: float,
    backoff_multiplier: float,
) -> str:
    method_config: dict[str, Any] = {"name": [{}]}  # [{}] matches every method
    if retry_unavailable and max_attempts > 1:
        method_config["retryPolicy"] = {
            "maxAttempts": max_attempts,
            "initialBackoff": f"{initial_backoff_s:.3f}s",
            "maxBackoff": f"{max_backoff_s:.3f}s",
            "backoffMultiplier": backoff_multiplier,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
    return json.dumps({"methodConfig": [method_config]})


def create_channel(
    address: str,
    *,
    tls: TLSConfig | None = None,
    auth_token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    retry_unavailable: bool = True,
    max_attempts: int = 5,
    initial_backoff_s: float = 0.2,
    max_backoff_s: float = 5.0,
    backoff_multiplier: float = 2.0,
    options: Sequence[tuple[str, Any]] = (),
    security: Security | None = None,
) -> grpc.Channel:
    """A channel to ``address`` ("host:port") with retries, keepalive and size limits.

    Retries: calls that fail with UNAVAILABLE (server down or restarting, or a
    handler raising ``Unavailable``) are retried by gRPC itself, up to
    ``max_attempts`` attempts in all (gRPC caps this at 5), with exponential
    backoff from ``initial_backoff_s`` to ``max_backoff_s`` (randomized). The call's
    deadline bounds all attempts together. A call is retried only until the
    first response message arrives, and only while its request fits the retry
    buffer (sized to ``max_message_bytes``).

    Connections: each channel has its own (not gRPC's shared pool), and reconnects
    after 0.1 s growing to at most 1 s, so a service restarted on its address is
    reached at once by a new channel and within a second by an old one.

    Args:
        address: ``"host:port"``.
        tls: connect with TLS (and a client certificate if ``tls.cert``); None: plaintext.
        auth_token: send ``authorization: Bearer <auth_token>`` on every call.
        max_message_bytes: send and receive limit per message.
        retry_unavailable: retry UNAVAILABLE as above.
        max_attempts: attempts per call including the first.
        initial_backoff_s, max_backoff_s, backoff_multiplier: the retry backoff.
        options: more channel arguments.
        security: credentials and TLS used where ``auth_token``/``tls`` are None;
            None: the process's (:func:`current_security`).
    """
    security = security if security is not None else current_security()
    if security is not None:
        if auth_token is None and security.credentials is not None:
            auth_token = security.credentials.token
        if tls is None:
            tls = security.client_tls()
    channel_options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1 if retry_unavailable else 0),
        ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
        (
            "grpc.service_config",
            _service_config(
                retry_unavailable=retry_unavailable,
                max_attempts=max_attempts,
                initial_backoff_s=initial_backoff_s,
                max_backoff_s=max_backoff_s,
                backoff_multiplier=backoff_multiplier,
            ),
        ),
        ("grpc.keepalive_time_ms", _KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A connection of this channel's own: gRPC's process-wide subchannel pool
        # would hand a new channel to a restarted service (same address) the dead
        # one's reconnect backoff, and its first call would wait 1.5-3.5 s.
        ("grpc.use_local_subchannel_pool", 1),
        # Services restart on their address within seconds: try again soon, not
        # after gRPC's default backoff (1 s growing to 120 s).
        # (gRPC's min_reconnect_backoff_ms is also the connection attempt's deadline,
        # 20 s: left alone, or a busy peer's slow handshake would count as a failure.)
        ("grpc.initial_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[1]),
    ]
    if tls is not None and tls.server_name_override:
        channel_options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    channel_options.extend(options)
    if tls is not None:
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=channel_options)
    else:
        channel = grpc.insecure_channel(address, options=channel_options)
    return grpc.intercept_channel(channel, _BearerTokenClientInterceptor(auth_token))


def call_options(
    timeout_s: float | None = DEFAULT_TIMEOUT_S, *, wait_for_ready: bool = False
) -> dict[str, Any]:
    """Keyword arguments for a stub call: ``stub.Score(req, **call_options(10))``.

    Args:
        timeout_s: the call's deadline in seconds, retries included; None: no
            deadline (only for calls that legitimately run unbounded, e.g. watches).
        wait_for_ready: wait (within the deadline) for the server to come up
            instead of failing fast with UNAVAILABLE while it is unreachable.
    """
    return {"timeout": timeout_s, "wait_for_ready": wait_for_ready}


def _health_status(
    channel: grpc.Channel, service: str, timeout_s: float, wait_for_ready: bool
) -> str:
    """The health status name, or the status code name of the failed check."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout_s,
            wait_for_ready=wait_for_ready,
        )
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        return code.name if code is not None else "UNKNOWN"
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


def check_health(
    channel: grpc.Channel, service: str = "", *, timeout_s: float = 5.0, wait: bool = False
) -> bool:
    """True iff the server answers SERVING for ``service`` ("" = the server).

    Any failure (unreachable, NOT_SERVING, unknown service, deadline) is False.
    ``wait``: wait up to ``timeout_s`` for an unreachable server to come up.
    """
    return _health_status(channel, service, timeout_s, wait) == "SERVING"


class Watchdog:
    """Cancels a call whose peer stopped answering while the call runs.

    Every ``liveness_s`` without :meth:`progress`, ``probe()`` runs (a health check,
    a status call: it must answer within ``liveness_s`` when the peer is alive, and
    return False or raise ``grpc.RpcError`` otherwise); when it fails, ``cancel()``
    is called and :attr:`verdict` says why. A busy peer answers its probe and is
    left alone; a stopped (SIGSTOP) or stuck one is given up within about three
    ``liveness_s``, not the call's deadline. Use as a context manager around the call.
    """

    def __init__(
        self, probe: Callable[[], bool], cancel: Callable[[], Any], liveness_s: float, what: str
    ) -> None:
        self._probe = probe
        self._cancel = cancel
        self._limit = liveness_s
        self._what = what
        self._last = time.monotonic()
        self._done = threading.Event()
        self.verdict: str | None = None
        self._thread = threading.Thread(target=self._run, name="rlfleet-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def progress(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._done.wait(self._limit):
            quiet = time.monotonic() - self._last
            if quiet < self._limit:
                continue
            try:
                alive = self._probe()
                why = "it is not SERVING"
            except grpc.RpcError as e:
                alive = False
                why = e.code().name if hasattr(e, "code") else str(e)
            if alive or self._done.is_set():
                continue
            self.verdict = (
                f"nothing for {quiet:.1f}s and its liveness probe failed within "
                f"{self._limit:.1f}s ({why})"
            )
            logger.warning("%s: %s", self._what, self.verdict)
            self._cancel()
            return

    def error(self, address: str) -> Unavailable:
        """The error to raise once :attr:`verdict` is set."""
        return Unavailable(
            f"{self._what} stopped answering: {self.verdict}", field="address", value=address
        )


def health_probe(channel: grpc.Channel, timeout_s: float) -> Callable[[], bool]:
    """A :class:`Watchdog` probe: the server's gRPC health answers SERVING in time."""
    return lambda: check_health(channel, timeout_s=timeout_s)


def wait_for_ready(
    address: str,
    *,
    timeout_s: float = 30.0,
    service: str = "",
    tls: TLSConfig | None = None,
    poll_interval_s: float = 0.1,
) -> None:
    """Block until the server at ``address`` reports ``service`` SERVING.

    Raises:
        Unavailable: not SERVING within ``timeout_s``; says what it last saw.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    channel = create_channel(address, tls=tls, retry_unavailable=False)
    with contextlib.closing(channel):
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            last = _health_status(channel, service, min(remaining, 5.0), wait_for_ready=True)
            if last == "SERVING":
                return
            time.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))
    raise Unavailable(
        f"{address} did not report service {service!r} SERVING within {timeout_s}s "
        f"(last health check: {last})",
        field="address",
        value=address,
    )
