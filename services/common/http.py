"""The HTTP side of every service (``/metrics``, ``/sd``): authenticated, TLS-capable, bounded.

::

    endpoint = serve_http("127.0.0.1", 0, {"/metrics": metrics_route(registry)})
    endpoint.port                      # the bound port
    endpoint.stop()

With the process's :class:`~rlfleet.common.rpc.Security` (or one given), a request
needs ``Authorization: Bearer <token>`` of any role of the credential set (401
otherwise), and the listener speaks TLS when the security has a certificate
(client certificates required for mTLS). Prometheus scrapes with the observer's
token (``authorization: {credentials_file: .../observer.token}``).

Bounds: GET only, a 10 s socket time-out per connection (a slow client holds one
thread at most that long), at most :data:`MAX_CONNECTIONS` connections that have
sent an authenticated request and as many that have not yet (a new one beyond that
closes the oldest of those: idle sockets opened without a token never lock out a
caller with one), request lines and headers as limited by ``http.server``.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import urllib.request
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlfleet.common.auth import Authenticator, audience_token, http_audience
from rlfleet.common.rpc import Security, current_security

__all__ = [
    "MAX_CONNECTIONS",
    "HttpEndpoint",
    "Route",
    "http_get",
    "metrics_route",
    "serve_handler",
    "serve_http",
]

logger = logging.getLogger(__name__)

Route = Callable[[], tuple[int, str, bytes]]
"""A page: ``() -> (status, content type, body)``."""

MAX_CONNECTIONS = 64
_SOCKET_TIMEOUT_S = 10.0


def metrics_route(registry: Any) -> Route:
    """``/metrics`` of a ``prometheus_client`` registry."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    def page() -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE_LATEST, bytes(generate_latest(registry))

    return page


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog (socketserver's default is 5): connections beyond it wait for
    # SYN retransmits (seconds) before the accept loop can even refuse them.
    request_queue_size = 2 * MAX_CONNECTIONS

    def __init__(
        self,
        address: tuple[str, int],
        routes: Mapping[str, Route],
        authenticator: Authenticator | None,
        context: ssl.SSLContext | None,
        *,
        handler: type[BaseHTTPRequestHandler] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        app: Any = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.routes = dict(routes)
        self.authenticator = authenticator
        self.app = app  # what a custom handler serves (``self.server.app``)
        self.max_connections = max_connections
        self.request_queue_size = 2 * max_connections
        self.open = 0  # connections being handled now
        self._count = threading.Lock()
        # Connections not yet admitted (no authenticated request yet), oldest first,
        # and the number admitted: each pool has max_connections places.
        self._strangers: dict[int, Any] = {}
        self._admitted: set[int] = set()
        super().__init__(address, handler or _Handler)
        if context is not None:
            # The handshake happens on the handler's thread (first read), never in
            # the accept loop, so a silent client cannot stall other connections.
            self.socket = context.wrap_socket(
                self.socket, server_side=True, do_handshake_on_connect=False
            )

    def process_request(self, request: Any, client_address: Any) -> None:
        # A new connection is a stranger until a request on it authenticates
        # (admit). Strangers beyond the cap push out the oldest stranger, never an
        # admitted caller: idle sockets opened without a token cannot lock callers
        # with one out, they only push each other out.
        with self._count:
            if len(self._strangers) >= self.max_connections:
                oldest = next(iter(self._strangers))
                _hang_up(self._strangers.pop(oldest))
                logger.warning(
                    "http: %d connections without an authenticated request: closed the oldest",
                    self.max_connections,
                )
            self._strangers[id(request)] = request
            self.open += 1
        super().process_request(request, client_address)

    def admit(self, request: Any) -> bool:
        """Count ``request``'s connection as a caller's (it sent an authenticated
        request); False when :attr:`max_connections` callers are connected already."""
        key = id(request)
        with self._count:
            if key in self._admitted:
                return True
            if len(self._admitted) >= self.max_connections:
                return False
            self._strangers.pop(key, None)
            self._admitted.add(key)
            return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.open -= 1
                self._strangers.pop(id(request), None)
                self._admitted.discard(id(request))

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("http: connection from %s failed", client_address, exc_info=True)


def _hang_up(request: Any) -> None:
    """End a connection another thread is serving: its next read or write fails."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = _SOCKET_TIMEOUT_S

    def do_GET(self) -> None:
        if not self._authorized():
            self._reply(401, "text/plain", b"unauthorized: send Authorization: Bearer <token>\n")
            return
        if not self.server.admit(self.request):
            self.close_connection = True
            self._reply(503, "text/plain", b"too many connections\n")
            return
        route = self.server.routes.get(self.path.split("?", 1)[0])
        if route is None:
            paths = " or ".join(sorted(self.server.routes))
            self._reply(404, "text/plain", f"try {paths}\n".encode())
            return
        status, content_type, body = route()
        self._reply(status, content_type, body)

    def do_POST(self) -> None:
        self._reply(405, "text/plain", b"GET only\n")

    do_PUT = do_DELETE = do_PATCH = do_POST

    def _authorized(self) -> bool:
        auth = self.server.authenticator
        if auth is None:
            return True
        values = self.headers.get_all("Authorization") or []
        if len(values) != 1 or not values[0].startswith("Bearer "):
            return False
        token = values[0][len("Bearer ") :].strip()
        return auth.role_of(token, http_audience(self.path)) is not None

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        if code == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("http: " + format, *args)


class HttpEndpoint:
    """A running HTTP server (see :func:`serve_http`)."""

    def __init__(self, server: _Server, host: str) -> None:
        self._server = server
        self.host = host
        self.port = int(server.server_address[1])
        self.tls = isinstance(server.socket, ssl.SSLSocket)
        self._thread = threading.Thread(
            target=server.serve_forever, name="rlfleet-http", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections being handled now (at most :data:`MAX_CONNECTIONS`)."""
        return self._server.open

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def shutdown(self) -> None:
        """Stop serving (``http.server``'s name, so callers of either work alike)."""
        self._server.shutdown()

    def server_close(self) -> None:
        self._server.server_close()


def serve_http(
    host: str,
    port: int,
    routes: Mapping[str, Route],
    *,
    security: Security | None = None,
) -> HttpEndpoint:
    """Serve ``routes`` on ``host:port`` (0: a free port) with the security's auth and TLS.

    ``security`` None: the process's (:func:`~rlfleet.common.rpc.current_security`);
    when that is None too, the endpoint is open plaintext (in-process tests).
    """
    authenticator, context = _security_parts(security)
    server = _Server((host, port), routes, authenticator, context)
    return HttpEndpoint(server, host)


def serve_handler(
    host: str,
    port: int,
    handler: type[BaseHTTPRequestHandler],
    app: Any,
    *,
    security: Security | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> HttpEndpoint:
    """Serve a custom ``handler`` class (its requests see ``app`` as ``self.server.app``
    and the credential set's :class:`~rlfleet.common.auth.Authenticator` as
    ``self.server.authenticator``, None when auth is off) with the same TLS, connection
    cap and listen backlog as :func:`serve_http`. The handler authenticates each
    request itself (it knows which roles its routes take)."""
    authenticator, context = _security_parts(security)
    server = _Server(
        (host, port),
        {},
        authenticator,
        context,
        handler=handler,
        max_connections=max_connections,
        app=app,
    )
    return HttpEndpoint(server, host)


def _security_parts(
    security: Security | None,
) -> tuple[Authenticator | None, ssl.SSLContext | None]:
    security = security if security is not None else current_security()
    authenticator = None
    context = None
    if security is not None:
        if security.credentials is not None:
            authenticator = security.credentials.authenticator()
        tls = security.server_tls()
        if tls is not None:
            context = tls.ssl_server_context()
    return authenticator, context


def http_get(
    address: str, path: str, *, security: Security | None = None, timeout_s: float = 5.0
) -> bytes:
    """GET ``path`` from another rlfleet endpoint with this process's token (and TLS)."""
    security = security if security is not None else current_security()
    scheme = "http"
    context = None
    headers = {}
    if security is not None:
        if security.credentials is not None:
            token = audience_token(security.credentials.token, http_audience(path))
            headers["Authorization"] = f"Bearer {token}"
        tls = security.client_tls()
        if tls is not None and security.server_tls() is not None:
            scheme = "https"
            context = ssl.create_default_context(cafile=str(tls.ca) if tls.ca else None)
            if tls.cert is not None:
                context.load_cert_chain(str(tls.cert), str(tls.key))
    request = urllib.request.Request(f"{scheme}://{address}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as r:
        body: bytes = r.read()
        return body
