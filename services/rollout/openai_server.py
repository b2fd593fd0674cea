"""The OpenAI-compatible endpoint over HTTP (``rlfleet serve rollout --openai-port P``):
the request handler around :class:`~rlfleet.rollout.openai_api.OpenAIFrontend`, its
start-up, its flags and its metrics. What the endpoint does: :mod:`rlfleet.rollout.openai_api`.

HTTP/1.1 with keep-alive on :func:`rlfleet.common.http.serve_handler` (TLS, connection
cap, listen backlog); streams are Server-Sent Events in chunked transfer encoding.
Every request is authenticated first (bearer token of a role in
``OPENAI_ENDPOINT_ROLES``), whatever its method or path.
"""

from __future__ import annotations

import argparse
import json
import logging
import select
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler
from typing import Any

from rlfleet.common import cli_args
from rlfleet.common.auth import ADMIN, HTTP_OPENAI, OPENAI_ENDPOINT_ROLES
from rlfleet.common.http import HttpEndpoint, serve_handler
from rlfleet.common.rpc import Security
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.openai_api import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_S,
    SESSION_HEADER,
    ApiError,
    Choice,
    OpenAIFrontend,
    OpenAIOptions,
    parse_body,
)
from rlfleet.rollout.trajectories import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_TTL_S,
    TrajectoryStore,
)

__all__ = [
    "OPENAI_FLAG_DEFAULTS",
    "add_openai_arguments",
    "load_tokenizer",
    "openai_config_defaults",
    "openai_from_args",
    "openai_url",
    "register_store_metrics",
    "start_openai_server",
]

logger = logging.getLogger(__name__)


_HANGUP = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR


class _ClientWatch:
    """Cancels a generation whose client closed its connection: the socket is polled
    for a hang-up every :data:`WATCH_INTERVAL_S` on a thread of its own while the
    generation runs, so an abandoned request frees the replica at once rather than
    when its answer is written (or at ``request_timeout_s``)."""

    WATCH_INTERVAL_S = 0.1

    def __init__(self, connection: Any) -> None:
        self._fd = connection.fileno()
        self._stopped = threading.Event()
        self.gone = False

    def arm(self, cancel: Callable[[], None]) -> None:
        """Start watching; ``cancel`` stops the generation."""
        threading.Thread(
            target=self._watch, args=(cancel,), name="rlfleet-openai-watch", daemon=True
        ).start()

    def _watch(self, cancel: Callable[[], None]) -> None:
        poller = select.poll()
        poller.register(self._fd, _HANGUP)
        interval_ms = int(self.WATCH_INTERVAL_S * 1000)
        while not self._stopped.is_set():
            hung_up = any(ev & _HANGUP for _, ev in poller.poll(interval_ms))
            if hung_up and not self._stopped.is_set():
                self.gone = True
                cancel()
                return

    def stop(self) -> None:
        """Stop watching (the thread ends within an interval; not waited for, so the
        answer is not held back by it)."""
        self._stopped.set()


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive; SSE streams use chunked transfer encoding."""

    protocol_version = "HTTP/1.1"
    server_version = "rlfleet-openai"
    server: Any  # rlfleet.common.http._Server, with .app = OpenAIFrontend

    def setup(self) -> None:
        # StreamRequestHandler.setup applies it as the connection's socket time-out.
        self.timeout = self.server.app.options.idle_timeout_s  # type: ignore[misc]
        super().setup()

    @property
    def app(self) -> OpenAIFrontend:
        app: OpenAIFrontend = self.server.app
        return app

    # ------------------------------------------------------------------ plumbing

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("openai: " + format, *args)

    def _send_json(self, status: int, obj: Any, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, e: ApiError) -> None:
        self._send_json(e.status, e.body())

    def _authorize(self) -> None:
        self._check_token()
        if not self.server.admit(self.request):
            self.close_connection = True
            raise ApiError(503, "too many connections: try again later", code="overloaded")

    def _check_token(self) -> None:
        auth = self.server.authenticator
        if auth is None:
            return
        values = self.headers.get_all("Authorization") or []
        if len(values) != 1 or not values[0].startswith("Bearer "):
            raise ApiError(
                401,
                "send Authorization: Bearer <api key> (a token of the cluster's credential "
                "set: agent.token)",
                code="invalid_api_key",
            )
        role = auth.role_of(values[0][len("Bearer ") :].strip(), HTTP_OPENAI)
        if role is None:
            raise ApiError(401, "the api key is not valid for this cluster", code="invalid_api_key")
        if role != ADMIN and role not in OPENAI_ENDPOINT_ROLES:
            raise ApiError(
                403,
                f"role {role!r} may not use the OpenAI endpoint (allowed: "
                f"{', '.join(sorted(OPENAI_ENDPOINT_ROLES))})",
                code="permission_denied",
            )

    def _read_body(self) -> dict[str, Any]:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length, not chunked")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            self.close_connection = True
            raise ApiError(411, "a Content-Length header is required")
        raw_len = lengths[0]
        if len(lengths) > 1:  # which one frames the body is ambiguous (smuggling)
            self.close_connection = True
            raise ApiError(400, f"{len(lengths)} Content-Length headers; send one")
        try:
            length = int(raw_len) if raw_len.strip().isdigit() else -1
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {raw_len[:40]!r}")
        limit = self.app.options.max_body_bytes
        if length > limit:
            self.close_connection = True  # the body stays unread
            raise ApiError(
                413,
                f"the body is {length} bytes, this endpoint takes at most {limit}",
                code="request_too_large",
            )
        raw = self.rfile.read(length)
        self._body_read = True
        return parse_body(raw)

    def _route(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path
        self._body_read = False
        self._streaming = False
        try:
            self._authorize()
            if method == "GET":
                if path in ("/v1/models", "/models"):
                    self._send_json(200, self.app.models())
                    return
                raise ApiError(404, f"no route GET {path}")
            if path in ("/v1/chat/completions", "/chat/completions"):
                self._generate("chat", self._read_body())
                return
            if path in ("/v1/completions", "/completions"):
                self._generate("completion", self._read_body())
                return
            parts = path.strip("/").split("/")
            if (
                len(parts) == 4
                and parts[:2] == ["v1", "sessions"]
                and parts[3]
                in (
                    "reward",
                    "finish",
                )
            ):
                body = self._read_body()
                sid = urllib.parse.unquote(parts[2])
                out = self.app.finish_session(sid, body, reward_required=parts[3] == "reward")
                self._send_json(200, out)
                return
            raise ApiError(404, f"no route POST {path}")
        except ApiError as e:
            if method == "POST" and not self._body_read:
                self.close_connection = True  # its body is still unread on the socket
            self._error(e)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception:
            logger.exception("openai: %s %s failed", method, path)
            self.close_connection = True
            if not self._streaming:  # else the status is sent: the stream just ends
                self._error(ApiError(500, "internal error (logged by the replica)"))

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _not_allowed(self) -> None:
        self.close_connection = True  # a body, if any, is not read
        try:
            self._authorize()  # strangers learn nothing, not even which methods exist
            raise ApiError(405, f"{self.command} is not allowed: GET or POST")
        except ApiError as e:
            self._error(e)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed

    # ------------------------------------------------------------------ generation

    def _generate(self, kind: str, body: dict[str, Any]) -> None:
        prep = self.app.prepare(kind, body, self.headers.get(SESSION_HEADER))
        watch = _ClientWatch(self.connection)
        try:
            self._answer(prep, watch)
        except (ApiError, OSError):
            if not watch.gone:
                raise
            logger.info("openai: client of session %s went away: generation cancelled",
                        prep.session_id)  # fmt: skip
            self.close_connection = True
        finally:
            watch.stop()

    def _answer(self, prep: Any, watch: _ClientWatch) -> None:
        app = self.app
        headers = {SESSION_HEADER: prep.session_id}
        if not prep.stream:
            choices = sorted(app.generate(prep, on_submit=watch.arm), key=lambda c: c.index)
            for c in choices:  # recorded once the whole answer is there to return
                app.record(prep, c)
            self._send_json(200, app.response(prep, choices), headers)
            return
        gen = app.generate(prep, on_submit=watch.arm)
        try:
            first = next(gen)  # errors before any event still answer with a status
        except StopIteration:
            first = None
        self._streaming = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header(SESSION_HEADER, prep.session_id)
        self.end_headers()
        done: list[Choice] = []
        try:
            pending = [first] if first is not None else []
            while True:
                for c in pending:
                    for chunk in app.chunks(prep, c):
                        self._event(json.dumps(chunk, ensure_ascii=False))
                    app.record(prep, c)  # written to the socket: the agent has it
                    done.append(c)
                try:
                    pending = [next(gen)]
                except StopIteration:
                    break
            if prep.include_usage:
                self._event(json.dumps(app.usage_chunk(prep, done)))
        except ApiError as e:
            self._event(json.dumps(e.body()))
        finally:
            gen.close()
        self._event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _event(self, data: str) -> None:
        payload = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")


def start_openai_server(
    core: RolloutCore,
    tokenizer: Any,
    store: TrajectoryStore,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    options: OpenAIOptions | None = None,
    security: Security | None = None,
) -> HttpEndpoint:
    """Serve the OpenAI-compatible API of ``core`` on ``host:port`` (0: a free port) with
    the process's (or the given) security: bearer tokens of the credential set, TLS when
    it has a certificate. Returns the running endpoint (``.port``, ``.tls``, ``.stop()``)."""
    options = options or OpenAIOptions()
    frontend = OpenAIFrontend(core, tokenizer, store, options)
    return serve_handler(
        host,
        port,
        _Handler,
        frontend,
        security=security,
        max_connections=options.max_connections,
    )


def register_store_metrics(registry: Any, store: TrajectoryStore) -> None:
    """Export the store's state on a replica's ``/metrics`` (read when scraped):
    ``rlfleet_rollout_trajectory_sessions{state="open"|"finished_waiting"}``,
    ``rlfleet_rollout_trajectory_tokens`` and ``rlfleet_rollout_trajectory_events_total{event}``
    (completions recorded, sessions finished, popped, evicted open / finished, expired,
    oversized). ``registry`` None (no prometheus_client): nothing."""
    if registry is None:
        return
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> Iterator[Any]:
            s = store.stats()
            sessions = GaugeMetricFamily(
                "rlfleet_rollout_trajectory_sessions",
                "sessions recorded by the OpenAI endpoint, by state",
                labels=["state"],
            )
            for state in ("open", "finished_waiting"):
                sessions.add_metric([state], s[state])
            yield sessions
            yield GaugeMetricFamily(
                "rlfleet_rollout_trajectory_tokens",
                "prompt + generated tokens held by the trajectory store",
                value=s["tokens"],
            )
            events = CounterMetricFamily(
                "rlfleet_rollout_trajectory_events",
                "trajectory store events",
                labels=["event"],
            )
            for event in (
                "completions", "finished", "popped", "evicted_open", "evicted_finished",
                "expired", "oversized",
            ):  # fmt: skip
                events.add_metric([event], s[event])
            yield events

    registry.register(_Collector())


def openai_url(endpoint: HttpEndpoint, host: str) -> str:
    """``http(s)://host:port/v1``: the ``base_url`` an OpenAI client takes."""
    scheme = "https" if endpoint.tls else "http"
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{h}:{endpoint.port}/v1"


def load_tokenizer(model: str, *, trust_remote_code: bool = False) -> Any:
    """The model folder's tokenizer (the endpoint's chat template, encode and decode)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model, local_files_only=True, trust_remote_code=trust_remote_code
    )


# --------------------------------------------------------------------------- CLI

#: What an OpenAI flag left unset takes without a config (``rollout.openai`` gives them).
OPENAI_FLAG_DEFAULTS: dict[str, Any] = {
    "openai_port": None,
    "openai_model_name": None,
    "openai_max_body_bytes": DEFAULT_MAX_BODY_BYTES,
    "openai_max_connections": DEFAULT_MAX_CONNECTIONS,
    "openai_request_timeout_s": DEFAULT_REQUEST_TIMEOUT_S,
    "trajectory_max_sessions": DEFAULT_MAX_SESSIONS,
    "trajectory_max_tokens": DEFAULT_MAX_TOKENS,
    "trajectory_ttl_s": DEFAULT_TTL_S,
}


def openai_config_defaults(section: Any) -> dict[str, Any]:
    """The flag defaults a config's ``rollout.openai`` section gives."""
    return {
        "openai_port": section.port,
        "openai_model_name": section.model_name,
        "openai_max_body_bytes": section.max_body_bytes,
        "openai_max_connections": section.max_connections,
        "openai_request_timeout_s": section.request_timeout_s,
        "trajectory_max_sessions": section.max_sessions,
        "trajectory_max_tokens": section.max_tokens,
        "trajectory_ttl_s": section.session_ttl_s,
    }


def add_openai_arguments(parser: argparse.ArgumentParser) -> None:
    """``--openai-port`` and the endpoint's bounds (``rollout.openai`` in a config)."""
    g = parser.add_argument_group("OpenAI-compatible endpoint (docs/rollout.md)")
    g.add_argument(
        "--openai-port",
        type=cli_args.port,
        default=None,
        help="serve /v1/chat/completions, /v1/completions, /v1/models on this port of --host "
        "(0 picks a free one); default: off (or rollout.openai.port)",
    )
    g.add_argument("--openai-model-name", default=None, help="model id served (default: --model)")
    g.add_argument("--openai-max-body-bytes", type=int, default=None, help="request body at most")
    g.add_argument(
        "--openai-max-connections", type=int, default=None, help="connections at once at most"
    )
    g.add_argument(
        "--openai-request-timeout-s",
        type=float,
        default=None,
        help="a request's generation at most (then 504)",
    )
    g.add_argument(
        "--trajectory-max-sessions", type=int, default=None, help="sessions recorded at most"
    )
    g.add_argument(
        "--trajectory-max-tokens",
        type=int,
        default=None,
        help="tokens (prompt + generated) recorded at most, over all sessions",
    )
    g.add_argument(
        "--trajectory-ttl-s", type=float, default=None, help="a session idle longer is dropped"
    )


def openai_from_args(args: argparse.Namespace) -> tuple[OpenAIOptions, TrajectoryStore]:
    """The endpoint's options and its store from resolved flags; ValueError on bad bounds."""
    options = OpenAIOptions(
        model_name=args.openai_model_name,
        max_body_bytes=args.openai_max_body_bytes,
        max_connections=args.openai_max_connections,
        request_timeout_s=args.openai_request_timeout_s,
    )
    store = TrajectoryStore(
        max_sessions=args.trajectory_max_sessions,
        max_tokens=args.trajectory_max_tokens,
        ttl_s=args.trajectory_ttl_s,
    )
    return options, store
