"""The tools package: the calculator's safe evaluation, the tool core's checks,
time-outs and failure handling, the Python tool in the real sandbox, the HTTP client
against a real local endpoint, and the proto round trips."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rlfleet.common.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable
from rlfleet.tools import serde
from rlfleet.tools.builtin import Calculator, PythonTool, evaluate
from rlfleet.tools.client import HttpToolClient, InProcessToolClient
from rlfleet.tools.core import (
    ToolCore,
    ToolError,
    ToolLimits,
    ToolResult,
    ToolSpec,
    check_arguments,
)
from rlfleet.v1 import tools_pb2

# ------------------------------------------------------------------ calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("6 * 7", "42"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("-3 + 5", "2"),
        ("+5 - -5", "10"),
        ("7 / 2", "3.5"),
        ("6 / 2", "3"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("4821 % 7", str(4821 % 7)),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("1.5 * 4", "6"),
        ("10 ** 20", str(10**20)),
        (" 1 + 1 ", "2"),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "not allowed"),
        ("open('/etc/passwd').read()", "not allowed"),
        ("x + 1", "not allowed"),
        ("(1).__class__", "not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 if 1 else 2", "not allowed"),
        ("1 < 2", "not allowed"),
        ("[1] * 3", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("1 << 3", "not allowed"),
        ("1j * 2", "only numbers"),
        ("1 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("2 ** 100000", "exceed"),
        ("9 ** 9 ** 9", "exceed"),
        ("2.0 ** 5000", "too large"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("1" * 300, "characters"),
        ("1" + " + 1" * 40, "operators"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(ToolError, match=why):
        evaluate(expression, max_ops=32)


def test_calculator_bounds_every_intermediate_integer() -> None:
    big = "9" * 80  # ~266 bits: allowed, its cube (~800 bits) too, its fourth power not
    assert evaluate(f"{big} * {big} * {big}", max_bits=1024) == str(int(big) ** 3)
    with pytest.raises(ToolError, match="exceeds 1024 bits"):
        evaluate(f"{big} * {big} * {big} * ({big})", max_bits=1024, max_chars=400)


# ------------------------------------------------------------------ the core


class Sleepy:
    def __init__(self, seconds: float, name: str = "sleepy") -> None:
        self.seconds = seconds
        self.started = 0
        self.given: list[float] = []  # the time-out each call started with
        self._name = name

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self._name, "sleeps", {"type": "object", "properties": {}})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        self.started += 1
        self.given.append(timeout_s)
        time.sleep(self.seconds)
        return "slept"


class Crashing:
    spec = ToolSpec("crash", "raises", {"type": "object"})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        raise RuntimeError("the tool's own bug")


class NotText:
    spec = ToolSpec("nottext", "returns a number", {"type": "object"})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        return 42  # type: ignore[return-value]


class Chatty:
    spec = ToolSpec("chatty", "prints a lot", {"type": "object"})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        return "é" * 100_000


@pytest.fixture
def core() -> Iterator[ToolCore]:
    tools = [Calculator(), Crashing(), NotText(), Chatty(), Sleepy(5.0)]
    with ToolCore(tools, ToolLimits(default_timeout_s=0.5, max_content_bytes=1000)) as c:
        yield c


def test_core_lists_tools_with_their_schemas(core: ToolCore) -> None:
    specs = {s.name: s for s in core.list_tools()}
    assert set(specs) == {"calculator", "crash", "nottext", "chatty", "sleepy"}
    assert specs["calculator"].parameters["required"] == ["expression"]
    assert specs["calculator"].to_openai()["function"]["name"] == "calculator"


def test_core_calls_a_tool(core: ToolCore) -> None:
    r = core.call("calculator", json.dumps({"expression": "12 * 12"}))
    assert r.ok and r.content == "144" and r.seconds >= 0


def test_unknown_tool_is_not_found_and_names_the_tools(core: ToolCore) -> None:
    with pytest.raises(NotFound, match="calculator") as e:
        core.call("nope", "{}")
    assert e.value.code == "UNKNOWN_TOOL"


@pytest.mark.parametrize("arguments", ["{", "[1, 2]", '"text"', "1", "{'a': 1}"])
def test_arguments_that_are_not_a_json_object_are_refused(core: ToolCore, arguments: str) -> None:
    with pytest.raises(InvalidArgument, match="arguments"):
        core.call("calculator", arguments)


def test_arguments_over_the_limit_are_refused_before_parsing() -> None:
    with (
        ToolCore([Calculator()], ToolLimits(max_arguments_bytes=64)) as c,
        pytest.raises(InvalidArgument) as e,
    ):
        c.call("calculator", json.dumps({"expression": "1" * 100}))
    assert e.value.code == "LIMIT_EXCEEDED"


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ({}, "missing required argument"),
        ({"expression": 12}, "must be of type string"),
        ({"expression": "1", "extra": 2}, "unknown argument"),
    ],
)
def test_arguments_off_the_schema_answer_the_model(
    core: ToolCore, arguments: dict[str, Any], why: str
) -> None:
    r = core.call("calculator", json.dumps(arguments))
    assert not r.ok and why in r.error


def test_check_arguments_types() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}},
    }
    check_arguments(schema, {"n": 3, "x": None})
    check_arguments(schema, {"n": 3, "x": 1.5})
    for bad in ({"n": True}, {"n": 1.5}, {"x": "1"}):
        with pytest.raises(ToolError):
            check_arguments(schema, bad)


def test_a_crashing_tool_answers_with_its_error(core: ToolCore) -> None:
    r = core.call("crash", "{}")
    assert r.error == "RuntimeError: the tool's own bug" and not r.timed_out
    assert core.call("calculator", '{"expression": "1 + 1"}').content == "2"  # still serving


def test_a_tool_error_is_the_message(core: ToolCore) -> None:
    r = core.call("calculator", '{"expression": "1 / 0"}')
    assert r.error == "division by zero"


def test_a_tool_that_returns_no_text_is_an_error(core: ToolCore) -> None:
    assert "not text" in core.call("nottext", "{}").error


def test_content_is_cut_to_the_limit(core: ToolCore) -> None:
    r = core.call("chatty", "{}")
    assert len(r.content.encode()) <= 1000 and r.content.endswith("(truncated)")


def test_a_slow_tool_times_out(core: ToolCore) -> None:
    r = core.call("sleepy", "{}", timeout_s=0.2)
    assert r.timed_out and "timed out after 0.2s" in r.error
    assert core.timeouts_total == 1


def test_a_call_still_queued_at_its_time_out_never_starts() -> None:
    slow = Sleepy(1.0)
    with ToolCore([slow], ToolLimits(max_concurrent_calls=1, default_timeout_s=5.0)) as c:
        first = threading.Thread(target=c.call, args=("sleepy", "{}"), kwargs={"timeout_s": 5.0})
        first.start()
        while slow.started == 0:
            time.sleep(0.01)
        r = c.call("sleepy", "{}", timeout_s=0.1)
        first.join()
        assert r.timed_out
        assert slow.started == 1  # the queued call was dropped, not run late


def test_a_call_that_waited_in_the_queue_runs_with_what_is_left() -> None:
    """The wait in the queue counts against a call's time-out: the tool gets what is
    left when it starts (a sandbox is killed then), not the whole time-out again."""
    slow = Sleepy(0.6)
    with ToolCore([slow], ToolLimits(max_concurrent_calls=1, default_timeout_s=5.0)) as c:
        first = threading.Thread(target=c.call, args=("sleepy", "{}"), kwargs={"timeout_s": 5.0})
        first.start()
        while slow.started == 0:
            time.sleep(0.01)
        r = c.call("sleepy", "{}", timeout_s=1.0)
        first.join()
    assert r.timed_out and slow.started == 2  # (this tool sleeps past what it is given)
    assert slow.given[0] == pytest.approx(5.0, abs=0.05)
    assert slow.given[1] < 0.5  # waited about 0.6 s of its 1 s


def test_time_outs_are_bounded_and_checked() -> None:
    lim = ToolLimits(default_timeout_s=2.0, max_timeout_s=3.0)
    assert lim.timeout(0) == 2.0 and lim.timeout(100) == 3.0 and lim.timeout(1) == 1.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument):
            lim.timeout(bad)
    with pytest.raises(ValueError, match="default_timeout_s"):
        ToolLimits(default_timeout_s=5.0, max_timeout_s=1.0)


def test_tool_names_are_checked_and_unique() -> None:
    with pytest.raises(ValueError, match="two tools"):
        ToolCore([Calculator(), Calculator()])
    with pytest.raises(InvalidArgument):
        ToolCore([Sleepy(0, name="bad name")])


def test_in_process_client_is_the_core(core: ToolCore) -> None:
    client = InProcessToolClient(core)
    assert [s.name for s in client.list_tools()] == core.names
    assert client.call("calculator", '{"expression": "3 * 3"}', timeout_s=1).content == "9"


# ------------------------------------------------------------------ python (sandboxed)


@pytest.fixture(scope="module")
def python_tool() -> PythonTool:
    from rlfleet.common.sandbox import Sandbox, SandboxLimits, probe

    report = probe()
    if not report.usable:
        pytest.skip(f"no sandbox isolation works here: {report.missing}")
    return PythonTool(Sandbox(SandboxLimits(timeout_s=10, cpu_time_s=10, memory_mb=512)))


def test_python_tool_answers_stdout(python_tool: PythonTool) -> None:
    with ToolCore([python_tool]) as c:
        r = c.call("python", json.dumps({"code": "print(sum(range(10)))"}))
    assert r.ok and r.content == "45\n"


def test_python_tool_answers_the_traceback(python_tool: PythonTool) -> None:
    with ToolCore([python_tool]) as c:
        r = c.call("python", json.dumps({"code": "print('before')\n1 / 0"}))
    assert "ZeroDivisionError" in r.error and "before" in r.error


def test_python_tool_cannot_write_outside_its_tmp(python_tool: PythonTool, tmp_path: Any) -> None:
    target = tmp_path / "escaped"
    code = f"open({str(target)!r}, 'w').write('x')"
    with ToolCore([python_tool]) as c:
        r = c.call("python", json.dumps({"code": code}))
    assert not r.ok and not target.exists()


def test_python_tool_is_killed_at_the_call_time_out(python_tool: PythonTool) -> None:
    with ToolCore([python_tool]) as c:
        r = c.call("python", json.dumps({"code": "while True: pass"}), timeout_s=1.0)
    assert not r.ok and "timed out" in r.error


# ------------------------------------------------------------------ HTTP tools


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        expr = body["arguments"].get("q", "")
        if self.path == "/slow":
            time.sleep(2.0)
        if self.path == "/drip":  # headers at once, then a byte every 0.1 s for 3 s
            self.send_response(200)
            self.send_header("Content-Length", "30")
            self.end_headers()
            for _ in range(30):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.1)
            return
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            self.end_headers()
            return
        if self.path == "/500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        out: Any = {"content": f"{body['name']}:{expr}"}
        if self.path == "/error":
            out = {"error": "no results"}
        if self.path == "/garbage":
            out = ["not", "an", "object"]
        data = json.dumps(out).encode()
        if self.path == "/surrogate":  # a JSON escape that decodes to a lone surrogate
            data = b'{"content": "no results for \\ud83d"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (the time-out test) breaks the pipe: expected


@pytest.fixture(scope="module")
def http_base() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _http(url: str) -> HttpToolClient:
    return HttpToolClient(url, ToolSpec("search", "finds", {"type": "object"}))


def test_http_tool_posts_json_and_reads_content(http_base: str) -> None:
    r = _http(http_base + "/ok").call("search", '{"q": "cats"}', timeout_s=5)
    assert r.ok and r.content == "search:cats"


@pytest.mark.parametrize(
    ("path", "why"),
    [("/error", "no results"), ("/500", "HTTP 500"), ("/garbage", "not a JSON object")],
)
def test_http_tool_failures_are_results(http_base: str, path: str, why: str) -> None:
    r = _http(http_base + path).call("search", "{}", timeout_s=5)
    assert not r.ok and why in r.error


def test_http_tool_does_not_follow_redirects(http_base: str) -> None:
    r = _http(http_base + "/redirect").call("search", "{}", timeout_s=5)
    assert "HTTP 302" in r.error


def test_http_tool_time_out_and_unreachable_raise(http_base: str) -> None:
    with pytest.raises(DeadlineExceeded):
        _http(http_base + "/slow").call("search", "{}", timeout_s=0.3)
    with pytest.raises(Unavailable):
        _http("http://127.0.0.1:1/x").call("search", "{}", timeout_s=2)


def test_http_tool_time_out_covers_the_whole_answer(http_base: str) -> None:
    """A server that drips its answer does not hold the call past its time-out (the
    socket's time-out is per read)."""
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        _http(http_base + "/drip").call("search", "{}", timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0  # the drip takes 3 s


def test_http_tool_answer_is_valid_unicode(http_base: str) -> None:
    r = _http(http_base + "/surrogate").call("search", "{}", timeout_s=5)
    assert r.ok and r.content == "no results for ?"
    r.content.encode("utf-8")  # what a tokenizer needs


def test_http_tool_ignores_proxy_settings(http_base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    r = _http(http_base + "/ok").call("search", '{"q": "x"}', timeout_s=5)
    assert r.ok and r.content == "search:x"


def test_http_tool_address_must_be_a_url() -> None:
    with pytest.raises(InvalidArgument):
        _http("ftp://127.0.0.1/x")


# ------------------------------------------------------------------ serde


def test_spec_and_result_round_trip() -> None:
    spec = Calculator().spec
    assert serde.spec_from_proto(serde.spec_to_proto(spec)) == spec
    r = ToolResult("out", error="bad", timed_out=True, seconds=1.5)
    back = serde.result_from_proto(serde.result_to_proto(r, "c1"))
    assert back == r


def test_a_listed_schema_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="JSON object"):
        serde.spec_from_proto(tools_pb2.ToolSpec(name="x", parameters_json="[1]"))
    with pytest.raises(InvalidArgument, match="not JSON"):
        serde.spec_from_proto(tools_pb2.ToolSpec(name="x", parameters_json="{"))
