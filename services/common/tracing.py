"""Traces: spans of a run's work across the driver and the services, as JSON lines.

A span is one piece of work (a step, a generation shard on one replica, a reward
call, a trainer phase) with a start, an end, its parent, and attributes. Each PPO
step is one trace; its id travels with every gRPC call made inside it in the
``rlfleet-trace`` metadata entry (``<trace id>-<span id>``, OpenTelemetry's hex
sizes), so a service's spans join the step's tree. Nothing needs the OpenTelemetry
SDK: spans are written, in OTLP's field names, to ``<run dir>/traces/<process>.jsonl``
by the in-process exporter (one line per span, flushed as written), and
``rlfleet trace`` reads them back (:mod:`rlfleet.launch.trace_cli`). With
``trainer.trace_otlp_endpoint`` they also go, batched in a thread of their own, to
an OpenTelemetry collector as OTLP/HTTP JSON (:class:`OtlpExporter`).

Standard library only (every service imports it).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import logging
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "TRACEPARENT_KEY",
    "TRACE_METADATA_KEY",
    "OtlpExporter",
    "SpanContext",
    "Tracer",
    "attached",
    "current",
    "from_header",
    "header",
    "otlp_headers",
    "set_tracer",
    "span",
    "traceparent",
    "tracer",
]

logger = logging.getLogger(__name__)

TRACE_METADATA_KEY = "rlfleet-trace"
TRACEPARENT_KEY = "traceparent"
"""W3C Trace Context's entry, which OpenTelemetry-instrumented callers send: a service
joins such a caller's trace too, and rlfleet's own calls carry it beside their own."""
_HEADER = re.compile(r"^([0-9a-f]{32})-([0-9a-f]{16})$")
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
_MAX_ATTR_CHARS = 4096


@dataclass(frozen=True)
class SpanContext:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits


_CURRENT: contextvars.ContextVar[SpanContext | None] = contextvars.ContextVar(
    "rlfleet_trace", default=None
)


def current() -> SpanContext | None:
    """The span this code runs in (None: none)."""
    return _CURRENT.get()


def header() -> str | None:
    """The metadata value that carries the current span to a service (None: none)."""
    ctx = _CURRENT.get()
    return None if ctx is None else f"{ctx.trace_id}-{ctx.span_id}"


def traceparent() -> str | None:
    """The current span as a W3C ``traceparent`` value (sampled), None: none."""
    ctx = _CURRENT.get()
    return None if ctx is None else f"00-{ctx.trace_id}-{ctx.span_id}-01"


def from_header(value: str | bytes | None) -> SpanContext | None:
    """A caller's span from its metadata value, ``rlfleet-trace``'s or W3C
    ``traceparent``'s (version 00); None when absent or malformed (a malformed value
    from the network is ignored, never an error; so are all-zero ids, invalid in W3C)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not value or len(value) > 64:
        return None
    m = _HEADER.match(value) or _TRACEPARENT.match(value)
    if m is None or m.group(1) == _ZERO_TRACE or m.group(2) == _ZERO_SPAN:
        return None
    return SpanContext(m.group(1), m.group(2))


@contextlib.contextmanager
def attached(ctx: SpanContext | None) -> Iterator[None]:
    """Run the block inside ``ctx`` (another thread's span, a caller's)."""
    token = _CURRENT.set(ctx)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _new_id(nbytes: int) -> str:
    return os.urandom(nbytes).hex()


def _attr(value: Any) -> Any:
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
        return list(value)
    return str(value)[:_MAX_ATTR_CHARS]


def _otlp_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # OTLP/JSON: 64-bit integers as strings
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [_otlp_value(v) for v in value]}}
    return {"stringValue": "" if value is None else str(value)}


def otlp_headers(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """HTTP headers for the collector from ``OTEL_EXPORTER_OTLP_HEADERS`` (OpenTelemetry's
    own variable: ``key=value`` pairs, comma-separated, values URL-encoded), e.g. a
    collector's bearer token; from the environment, never a command line."""
    import urllib.parse

    raw = (os.environ if env is None else env).get("OTEL_EXPORTER_OTLP_HEADERS", "")
    headers: dict[str, str] = {}
    for pair in raw.split(","):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            headers[key.strip()] = urllib.parse.unquote(value.strip())
    return headers


class OtlpExporter:
    """Spans to an OpenTelemetry collector over OTLP/HTTP with JSON bodies (what a
    collector's ``otlphttp`` receiver takes at ``/v1/traces``), standard library only.

    :meth:`add` never blocks the traced work: spans wait in a bounded queue (the
    oldest dropped past ``max_queue``, counted in :attr:`dropped`) and a daemon
    thread posts them in batches of up to ``batch`` every ``interval_s``; a
    collector that fails or is slow costs a warning (once a minute at most) and the
    batch, never the run. :meth:`close` sends what is left within ``timeout_s``.

    Args:
        endpoint: ``http(s)://host:port/v1/traces``.
        service: the resource's ``service.name``.
        headers: more HTTP headers (a collector's own authentication).
    """

    def __init__(
        self,
        endpoint: str,
        service: str,
        *,
        headers: Mapping[str, str] | None = None,
        batch: int = 512,
        interval_s: float = 1.0,
        max_queue: int = 8192,
        timeout_s: float = 5.0,
    ) -> None:
        self.endpoint = endpoint
        self.service = service
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.batch, self.interval_s, self.timeout_s = batch, interval_s, timeout_s
        self.sent = 0
        self.dropped = 0
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._max_queue = max_queue
        self._cond = threading.Condition()
        self._closed = False
        self._warned = 0.0
        self._thread = threading.Thread(target=self._run, name="otlp-exporter", daemon=True)
        self._thread.start()

    def add(self, span: Mapping[str, Any]) -> None:
        """Queue one span (a :class:`Tracer` line's fields)."""
        with self._cond:
            if self._closed:
                return
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(dict(span))
            if len(self._queue) >= self.batch:
                self._cond.notify()

    def body(self, spans: list[dict[str, Any]]) -> bytes:
        """The ``ExportTraceServiceRequest`` of ``spans``, in OTLP's JSON mapping."""
        otlp = [
            {
                "traceId": sp["traceId"],
                "spanId": sp["spanId"],
                "parentSpanId": sp["parentSpanId"],
                "name": sp["name"],
                "kind": 1,  # SPAN_KIND_INTERNAL
                "startTimeUnixNano": str(sp["startTimeUnixNano"]),
                "endTimeUnixNano": str(sp["endTimeUnixNano"]),
                "attributes": [
                    {"key": k, "value": _otlp_value(v)} for k, v in sp["attributes"].items()
                ],
                "status": {"code": 2 if "error" in sp["attributes"] else 0},
            }
            for sp in spans
        ]
        resource = {"attributes": [{"key": "service.name", "value": {"stringValue": self.service}}]}
        request = {
            "resourceSpans": [
                {
                    "resource": resource,
                    "scopeSpans": [{"scope": {"name": "rlfleet"}, "spans": otlp}],
                }
            ]
        }
        return json.dumps(request, separators=(",", ":")).encode()

    def _post(self, spans: list[dict[str, Any]]) -> None:
        request = urllib.request.Request(
            self.endpoint, data=self.body(spans), headers=self.headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                answer.read()
            self.sent += len(spans)
        except Exception as e:  # the collector's problem: warn, drop the batch, go on
            self.dropped += len(spans)
            now = time.monotonic()
            if now - self._warned > 60:
                self._warned = now
                logger.warning("OTLP export to %s failed (%s): %d spans dropped so far",
                               self.endpoint, e, self.dropped)  # fmt: skip

    def _take(self) -> list[dict[str, Any]]:
        n = min(self.batch, len(self._queue))
        return [self._queue.popleft() for _ in range(n)]

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed and len(self._queue) < self.batch:
                    self._cond.wait(self.interval_s)
                spans = self._take()
                closed = self._closed
            if spans:
                self._post(spans)
            elif closed:
                return

    def close(self) -> None:
        """Send what is queued (within ``timeout_s`` per batch), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(self.timeout_s * (1 + len(self._queue) // self.batch) + 1)


class Tracer:
    """Writes the spans of one process to ``path`` (None: spans are not kept, but ids
    still propagate so the services' spans of a call still join their trace).

    Args:
        path: the JSON-lines file (made with its folder).
        service: ``service.name`` of every span (``driver``, ``rollout-0`` ...).
        otlp_endpoint: also send every span to this OTLP/HTTP collector URL
            (:class:`OtlpExporter`).
    """

    def __init__(
        self, path: str | Path | None, service: str, *, otlp_endpoint: str | None = None
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.service = service
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self.otlp = (
            OtlpExporter(otlp_endpoint, service, headers=otlp_headers()) if otlp_endpoint else None
        )

    def record(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        ctx: SpanContext,
        parent: SpanContext | None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """Write one finished span (also for work timed elsewhere, e.g. the trainer's
        phases laid out from their durations)."""
        if self._file is None and self.otlp is None:
            return
        fields = {
            "traceId": ctx.trace_id,
            "spanId": ctx.span_id,
            "parentSpanId": parent.span_id if parent is not None else "",
            "name": name,
            "service": self.service,
            "startTimeUnixNano": start_ns,
            "endTimeUnixNano": end_ns,
            "attributes": {k: _attr(v) for k, v in (attributes or {}).items()},
        }
        if self.otlp is not None:
            self.otlp.add(fields)
        if self._file is None:
            return
        line = json.dumps(fields, separators=(",", ":"))
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()

    @contextlib.contextmanager
    def timed(
        self, name: str, *, root: bool = False, **attributes: Any
    ) -> Iterator[tuple[SpanContext, dict[str, Any]]]:
        """Time the block as span ``name`` (child of the current one; ``root``: a new
        trace), without making it current; yields its context and its attributes
        (which the block may add to). A failure is recorded as ``error``."""
        parent = None if root else _CURRENT.get()
        ctx = SpanContext(parent.trace_id if parent else _new_id(16), _new_id(8))
        attrs = dict(attributes)
        start = time.time_ns()
        try:
            yield ctx, attrs
        except BaseException as e:
            attrs["error"] = f"{type(e).__name__}: {e}"[:_MAX_ATTR_CHARS]
            raise
        finally:
            self.record(name, start, time.time_ns(), ctx, parent, attrs)

    @contextlib.contextmanager
    def span(self, name: str, *, root: bool = False, **attributes: Any) -> Iterator[dict[str, Any]]:
        """A span around the block, current inside it (``root``: a new trace).

        Yields its attributes, which the block may add to.
        """
        with self.timed(name, root=root, **attributes) as (ctx, attrs), attached(ctx):
            yield attrs

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        if self.otlp is not None:
            self.otlp.close()


_TRACER = Tracer(None, "")


def tracer() -> Tracer:
    """This process's tracer (spans dropped until :func:`set_tracer`)."""
    return _TRACER


def set_tracer(t: Tracer) -> Tracer:
    """Make ``t`` this process's tracer; returns the previous one."""
    global _TRACER
    previous, _TRACER = _TRACER, t
    return previous


def record_child(name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """Write a finished span timed elsewhere as a child of the current one (none: no-op)."""
    parent = _CURRENT.get()
    if parent is not None:
        _TRACER.record(
            name, start_ns, end_ns, SpanContext(parent.trace_id, _new_id(8)), parent, attributes
        )


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """A span of this process's tracer, inside the current one."""
    return _TRACER.span(name, **attributes)


def service_trace_path(run_dir: str | Path, service: str) -> Path:
    """Where a process of a run writes its spans."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", service)[:64] or "process"
    return Path(run_dir) / "traces" / f"{safe}-{os.getpid()}.jsonl"


def traced_stream(name: str, items: Iterator[Any], **attributes: Any) -> Iterator[Any]:
    """``items`` passed through, recorded as one span (child of the current one) from
    the first item asked for to the last, with ``results`` counted. For streaming
    handlers, where a context variable cannot be held across the yields."""
    with _TRACER.timed(name, **attributes) as (_ctx, attrs):
        attrs["results"] = 0
        for item in items:
            attrs["results"] += 1
            yield item


def configure(config: Any, service: str) -> None:
    """A service of a run: its spans to ``<run dir>/traces/<service>-<pid>.jsonl`` when
    the run config has ``trainer.trace`` (None: a service without a run config keeps
    none; ids still propagate), and to ``trainer.trace_otlp_endpoint`` when set."""
    if config is None or not config.trainer.trace:
        return
    set_tracer(
        Tracer(
            service_trace_path(config.run_dir(), service),
            service,
            otlp_endpoint=config.trainer.trace_otlp_endpoint,
        )
    )
