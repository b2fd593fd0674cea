"""Spans: nesting, ids on the wire (malformed ones ignored), threads joining a trace,
and `rlfleet trace`'s reading of a step's tree and critical path."""

from __future__ import annotations

import contextvars
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common import tracing
from rlfleet.launch.trace_cli import critical_path, load_spans, step_trace


def test_spans_nest_and_carry_their_trace_over_the_wire_header(tmp_path: Path) -> None:
    t = tracing.Tracer(tmp_path / "traces" / "a.jsonl", "driver")
    previous = tracing.set_tracer(t)
    try:
        assert tracing.header() is None
        with tracing.span("step", root=True, step=1) as attrs:
            outer = tracing.current()
            assert outer is not None
            assert tracing.header() == f"{outer.trace_id}-{outer.span_id}"
            with tracing.span("generate"):
                inner = tracing.current()
            attrs["samples"] = 8
        assert tracing.current() is None
    finally:
        tracing.set_tracer(previous)
        t.close()
    assert inner is not None and inner.trace_id == outer.trace_id
    lines = [json.loads(x) for x in (tmp_path / "traces" / "a.jsonl").read_text().splitlines()]
    by_name = {d["name"]: d for d in lines}
    assert by_name["generate"]["parentSpanId"] == by_name["step"]["spanId"]
    assert by_name["step"]["parentSpanId"] == ""
    assert by_name["step"]["attributes"] == {"step": 1, "samples": 8}
    assert by_name["step"]["endTimeUnixNano"] >= by_name["generate"]["endTimeUnixNano"]


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "x" * 49,
        "ABCDEF" * 8,
        "0" * 32 + "-" + "0" * 15,
        "0" * 32 + "_" + "0" * 16,
        b"\xff",
    ],
)
def test_malformed_headers_are_ignored(value: str | bytes | None) -> None:
    assert tracing.from_header(value) is None


def test_a_header_round_trips() -> None:
    ctx = tracing.SpanContext("ab" * 16, "cd" * 8)
    with tracing.attached(ctx):
        assert tracing.from_header(tracing.header()) == ctx
        assert tracing.from_header(tracing.header().encode()) == ctx  # type: ignore[union-attr]
        assert tracing.traceparent() == f"00-{'ab' * 16}-{'cd' * 8}-01"
        assert tracing.from_header(tracing.traceparent()) == ctx
    assert tracing.traceparent() is None


@pytest.mark.parametrize(
    "value",
    [
        "01-" + "ab" * 16 + "-" + "cd" * 8 + "-01",  # an unknown version
        "00-" + "0" * 32 + "-" + "cd" * 8 + "-01",  # all-zero trace id: invalid in W3C
        "00-" + "ab" * 16 + "-" + "0" * 16 + "-01",
        "00-" + "AB" * 16 + "-" + "cd" * 8 + "-01",
        "00-" + "ab" * 16 + "-" + "cd" * 8,
    ],
)
def test_malformed_traceparents_are_ignored(value: str) -> None:
    assert tracing.from_header(value) is None


def test_a_thread_started_with_the_callers_context_joins_its_trace(tmp_path: Path) -> None:
    t = tracing.Tracer(tmp_path / "traces" / "b.jsonl", "driver")
    seen: list[tracing.SpanContext | None] = []
    with t.span("step", root=True) as _:
        ctx = contextvars.copy_context()
        outer = tracing.current()
        th = threading.Thread(target=ctx.run, args=(lambda: seen.append(tracing.current()),))
        th.start()
        th.join()
        bare = threading.Thread(target=lambda: seen.append(tracing.current()))
        bare.start()
        bare.join()
    t.close()
    assert seen == [outer, None]


def _write(path: Path, spans: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for s in spans:
            f.write(json.dumps(s) + "\n")


def _s(
    name: str, sid: str, parent: str, start: float, end: float, trace: str = "t", **attrs: object
) -> dict[str, object]:
    return {
        "traceId": trace * 32, "spanId": sid, "parentSpanId": parent, "name": name,
        "service": "driver", "startTimeUnixNano": int(start * 1e9),
        "endTimeUnixNano": int(end * 1e9), "attributes": attrs,
    }  # fmt: skip


def test_the_critical_path_follows_what_the_step_waited_for(tmp_path: Path) -> None:
    _write(
        tmp_path / "traces" / "driver.jsonl",
        [
            _s("step", "1", "", 0, 10, step=3),
            _s("generate", "2", "1", 0, 6),
            _s("generate.shard", "3", "2", 0, 2, replica="r0"),
            _s("generate.shard", "4", "2", 0, 5.5, replica="r1"),
            _s("train", "5", "1", 6, 9),
            _s("weight_sync", "6", "1", 9, 10),
        ],
    )
    (tmp_path / "traces" / "junk.jsonl").write_text("not json\n{}\n")
    (tmp_path / "traces" / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage\n")
    (tmp_path / "traces" / "folder.jsonl").mkdir()  # not a file: skipped
    root = step_trace(load_spans(tmp_path), 3)
    assert root is not None and [c.name for c in root.children] == [
        "generate", "train", "weight_sync",
    ]  # fmt: skip
    path = [(d, s.name, s.attributes.get("replica")) for d, s in critical_path(root)]
    assert path == [
        (0, "generate", None),
        (1, "generate.shard", "r1"),  # the shard that ended last; r0 ran alongside
        (0, "train", None),
        (0, "weight_sync", None),
    ]
    assert step_trace(load_spans(tmp_path), 4) is None


def test_trace_cli_output_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out where it cannot be written, or not an HTML page: exit 2 and one line."""
    import argparse

    from rlfleet.launch.trace_cli import add_arguments, run

    _write(tmp_path / "traces" / "driver.jsonl", [_s("step", "1", "", 0, 1, step=1)])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for out, why in (
        (tmp_path / "missing" / "t.html", "cannot write"),
        (tmp_path / "dir.html", "cannot write"),
        (tmp_path / "t.png", "HTML page"),
    ):
        if out.name == "dir.html":
            out.mkdir()
        args = parser.parse_args(["--run", str(tmp_path), "--step", "1", "--out", str(out)])
        assert run(args) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
    ok = parser.parse_args(
        ["--run", str(tmp_path), "--step", "1", "--out", str(tmp_path / "t.html")]
    )
    assert run(ok) == 0 and (tmp_path / "t.html").read_text().startswith("<!")


def test_a_prompts_path_through_a_requeue_and_a_trainer_restart(tmp_path: Path) -> None:
    """Synchronous step 3 (trace a): prompt 17 (place 1) was on r0, which failed, and
    was re-queued on r1; the train call failed. Step 3 again (trace b): generated on r0,
    trained. Pipelined step 5 (produce trace c; step traces d and e): generated once,
    kept across a trainer restart, so both step attempts trained it."""
    _write(
        tmp_path / "traces" / "driver.jsonl",
        [
            _s("step", "1", "", 0, 10, trace="a", step=3),
            _s("generate", "2", "1", 0, 5, trace="a", prompts=[4, 17]),
            _s("generate.shard", "3", "2", 0, 2, trace="a", replica="r0",
               prompt_indices=[0, 1], error="Unavailable", versions=[]),
            _s("generate.shard", "4", "2", 2, 4, trace="a", replica="r1",
               prompt_indices=[1], versions=[2]),
            _s("reward", "5", "2", 4, 5, trace="a", prompt_indices=[1]),
            _s("reward", "6", "2", 1, 2, trace="a", prompt_indices=[0]),
            _s("train", "7", "1", 5, 10, trace="a", error="Unavailable"),
            _s("step", "8", "", 20, 30, trace="b", step=3),
            _s("generate", "9", "8", 20, 24, trace="b", prompts=[4, 17]),
            _s("generate.shard", "10", "9", 20, 23, trace="b", replica="r0",
               prompt_indices=[0, 1], versions=[2]),
            _s("train", "11", "8", 24, 29, trace="b"),
            _s("produce", "12", "", 40, 45, trace="c", step=5),
            _s("generate", "13", "12", 40, 45, trace="c", prompts=[9, 17]),
            _s("generate.shard", "14", "13", 40, 44, trace="c", replica="r1",
               prompt_indices=[0, 1], versions=[4]),
            _s("step", "15", "", 46, 50, trace="d", step=5),
            _s("train", "16", "15", 46, 50, trace="d", error="Unavailable"),
            _s("step", "17", "", 60, 70, trace="e", step=5),
            _s("train", "18", "17", 60, 69, trace="e"),
            _s("weight_sync", "19", "17", 69, 70, trace="e", version=6),
        ],
    )  # fmt: skip
    from rlfleet.launch.trace_cli import prompt_path

    attempts = prompt_path(load_spans(tmp_path), 17)
    got = [
        (a.step, a.root, [(p.name, p.attributes.get("replica"), p.span_id) for p in a.parts])
        for a in attempts
    ]
    assert got == [
        (3, "step", [
            ("generate.shard", "r0", "3"), ("generate.shard", "r1", "4"),
            ("reward", None, "5"), ("train", None, "7"),
        ]),
        (3, "step", [("generate.shard", "r0", "10"), ("train", None, "11")]),
        (5, "produce", [
            ("generate.shard", "r1", "14"), ("train", None, "16"), ("train", None, "18"),
            ("weight_sync", None, "19"),
        ]),
    ]  # fmt: skip
    assert prompt_path(load_spans(tmp_path), 99) == []


#: Where ``make setup`` installs ``opentelemetry-proto`` (outside the environment: an
#: importable ``opentelemetry`` package makes Ray's dashboard load OpenTelemetry's
#: metrics API, which that package alone does not have).
OTLP_PROTO = Path(sys.prefix) / "otlp-proto"

_DECODE = """
import base64, json, sys
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

out = []
for body in json.load(sys.stdin):
    for rs in body["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    sp[key] = base64.b64encode(bytes.fromhex(sp[key])).decode()
    request = trace_service_pb2.ExportTraceServiceRequest()
    json_format.ParseDict(body, request)  # unknown fields, wrong types: ParseError
    for rs in request.resource_spans:
        service = [a.value.string_value for a in rs.resource.attributes
                   if a.key == "service.name"]
        for ss in rs.scope_spans:
            for sp in ss.spans:
                out.append([service, sp.trace_id.hex(), sp.span_id.hex(),
                            sp.parent_span_id.hex(), sp.name, sp.kind,
                            len(sp.trace_id), len(sp.span_id), len(sp.parent_span_id)])
print(json.dumps(out))
"""


def _official_otlp(bodies: list[dict[str, Any]]) -> list[list[Any]]:
    """``bodies`` read as OpenTelemetry's own ``ExportTraceServiceRequest`` (the
    ``opentelemetry-proto`` package, what a collector's ``otlphttp`` receiver decodes
    into), in a process of its own: per span, ``[service, trace id, span id, parent id,
    name, kind, id lengths...]``. An unknown field or a wrong type fails. OTLP's JSON
    mapping writes ids as hex, not proto3 JSON's base64: they are turned into base64
    first, as a collector does."""
    if not OTLP_PROTO.is_dir():
        pytest.skip(f"no opentelemetry-proto at {OTLP_PROTO}: `make setup` installs it there")
    env = {**os.environ, "PYTHONPATH": str(OTLP_PROTO)}
    done = subprocess.run(
        [sys.executable, "-c", _DECODE],
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    decoded: list[list[Any]] = json.loads(done.stdout)
    return decoded


class _Collector:
    """A stand-in OpenTelemetry collector on 127.0.0.1: its /v1/traces takes OTLP/HTTP
    JSON and keeps every request body; ``fail`` answers 503 instead. (No collector
    binary can be installed here; the bodies are checked against OpenTelemetry's own
    protobuf schema by :func:`_official_otlp`.)"""

    def __init__(self) -> None:
        import http.server
        import threading

        self.bodies: list[dict[str, Any]] = []
        self.authorization: list[str | None] = []
        self.fail = False
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == "/v1/traces" and not collector.fail
                collector.authorization.append(self.headers.get("Authorization"))
                if ok:
                    assert self.headers["Content-Type"] == "application/json"
                    collector.bodies.append(json.loads(body))
                self.send_response(200 if ok else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_spans_go_to_an_otlp_collector_as_well_as_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.trace_otlp_endpoint: the same spans, ids and attributes as the JSONL
    file, in OTLP's JSON mapping under the service's resource, with the collector's
    headers from OTEL_EXPORTER_OTLP_HEADERS; a collector that fails costs the batch
    (counted), not the traced work."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Bearer%20s3cret, x=1")
    assert tracing.otlp_headers() == {"Authorization": "Bearer s3cret", "x": "1"}
    collector = _Collector()
    try:
        t = tracing.Tracer(tmp_path / "d.jsonl", "driver", otlp_endpoint=collector.url)
        assert t.otlp is not None
        t.otlp.interval_s = 0.05
        with t.span("step", root=True, step=3):
            with t.span("gen", replica="rollout-0", tokens=[1, 2]):
                pass
            with pytest.raises(ValueError), t.span("reward"):
                raise ValueError("bad")
        t.close()
        lines = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
        [resource] = [rs for b in collector.bodies for rs in b["resourceSpans"]][:1]
        assert resource["resource"]["attributes"] == [
            {"key": "service.name", "value": {"stringValue": "driver"}}
        ]
        spans = [
            sp
            for b in collector.bodies
            for rs in b["resourceSpans"]
            for ss in rs["scopeSpans"]
            for sp in ss["spans"]
        ]
        assert [(s["traceId"], s["spanId"], s["parentSpanId"], s["name"]) for s in spans] == [
            (x["traceId"], x["spanId"], x["parentSpanId"], x["name"]) for x in lines
        ]
        decoded = _official_otlp(collector.bodies)
        assert [(d[1], d[2], d[3], d[4]) for d in decoded] == [
            (x["traceId"], x["spanId"], x["parentSpanId"], x["name"]) for x in lines
        ]
        assert all(d[0] == ["driver"] and d[5] == 1 for d in decoded)  # SPAN_KIND_INTERNAL
        assert all(d[6:8] == [16, 8] and d[8] in (0, 8) for d in decoded)
        assert next(d for d in decoded if d[4] == "step")[8] == 0  # the root: no parent
        by_name = {s["name"]: s for s in spans}
        assert {"key": "step", "value": {"intValue": "3"}} in by_name["step"]["attributes"]
        gen = dict((a["key"], a["value"]) for a in by_name["gen"]["attributes"])
        assert gen["replica"] == {"stringValue": "rollout-0"}
        assert gen["tokens"] == {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "2"}]}}
        assert by_name["reward"]["status"] == {"code": 2} and by_name["gen"]["status"] == {
            "code": 0
        }
        assert int(by_name["step"]["endTimeUnixNano"]) >= int(by_name["step"]["startTimeUnixNano"])
        assert t.otlp.sent == 3 and t.otlp.dropped == 0
        assert set(collector.authorization) == {"Bearer s3cret"}

        collector.fail = True
        t = tracing.Tracer(None, "rollout-0", otlp_endpoint=collector.url)
        assert t.otlp is not None
        with t.span("gen", root=True):
            pass
        t.close()
        assert (t.otlp.sent, t.otlp.dropped) == (0, 1)
    finally:
        collector.stop()


def test_the_otlp_endpoint_must_be_an_http_url() -> None:
    from rlfleet.common.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="trace_otlp_endpoint"):
        config_from_dict({}, ["trainer.trace_otlp_endpoint=file:///etc/passwd"])
    cfg = config_from_dict({}, ["trainer.trace_otlp_endpoint=http://127.0.0.1:4318/v1/traces"])
    assert cfg.trainer.trace_otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
