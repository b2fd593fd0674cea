"""``rollout.multi_turn.tools`` read from a config as a replica reads it
(``tool_box_from_config``): a ToolService by address (``grpc``), the run's tools
service (``service``, from ``services.tools``), one tool behind an HTTP URL (``http``)
and a built-in, each a real server on 127.0.0.1 called through the box the multi-turn
loop uses."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from rlfleet.common.config import config_from_dict
from rlfleet.rollout.multiturn import tool_box_from_config
from rlfleet.tools.builtin import Calculator
from rlfleet.tools.core import ToolCore
from rlfleet.tools.server import start_tool_server

pytestmark = pytest.mark.timeout(120)


class _Lookup(BaseHTTPRequestHandler):
    """An HTTP tool: answers ``{"content": "<key> is <len(key)> letters"}``."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Lookup.calls.append(body)
        key = str(body["arguments"].get("key", ""))
        out = json.dumps({"content": f"{key} is {len(key)} letters"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def servers() -> Iterator[tuple[str, str]]:
    grpc_server = start_tool_server(ToolCore([Calculator()]))
    http_server = ThreadingHTTPServer(("127.0.0.1", 0), _Lookup)
    thread = threading.Thread(target=http_server.serve_forever, daemon=True)
    thread.start()
    try:
        yield grpc_server.address, f"http://127.0.0.1:{http_server.server_address[1]}/lookup"
    finally:
        http_server.shutdown()
        http_server.server_close()
        grpc_server.stop(grace_s=1.0)


def _config(tools: list[dict[str, Any]], **extra: Any) -> Any:
    return config_from_dict(
        {
            "actor": {"model_path": "m"},
            "rollout": {"multi_turn": {"enable": True, "tools": tools}},
            **extra,
        }
    )


def test_every_kind_of_tool_source_is_reached_from_the_config(servers: tuple[str, str]) -> None:
    address, url = servers
    lookup = {
        "kind": "http",
        "name": "lookup",
        "address": url,
        "description": "how long a word is",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
    }
    config = _config([{"kind": "grpc", "address": address, "name": "calculator"}, lookup])
    box = tool_box_from_config(config)
    try:
        assert sorted(box.names) == ["calculator", "lookup"]
        calc = box.client("calculator")
        assert calc is not None
        assert calc.call("calculator", '{"expression": "6 * 7"}', timeout_s=10).content == "42"
        http = box.client("lookup")
        assert http is not None
        [spec] = http.list_tools()
        assert spec.description == "how long a word is" and spec.parameters == lookup["parameters"]
        result = http.call("lookup", '{"key": "fleet"}', timeout_s=10)
        assert result.content == "fleet is 5 letters" and not result.error
        assert _Lookup.calls[-1] == {"name": "lookup", "arguments": {"key": "fleet"}}
    finally:
        box.close()


def test_the_runs_tools_service_comes_from_services_tools(servers: tuple[str, str]) -> None:
    address, _ = servers
    box = tool_box_from_config(_config([{"kind": "service"}], services={"tools": address}))
    try:
        assert box.names == ["calculator"]
        calc = box.client("calculator")
        assert calc is not None
        assert calc.call("calculator", '{"expression": "2 ** 10"}', timeout_s=10).content == "1024"
    finally:
        box.close()
    # A name the service does not offer, and two sources offering one name: refused.
    with pytest.raises(ValueError, match="no tool named 'search'"):
        tool_box_from_config(
            _config([{"kind": "service", "name": "search"}], services={"tools": address})
        )
    with pytest.raises(ValueError, match="two tool sources offer a tool named 'calculator'"):
        tool_box_from_config(
            _config(
                [{"kind": "service"}, {"kind": "builtin", "name": "calculator"}],
                services={"tools": address},
            )
        )


def test_a_service_source_without_an_address_is_refused() -> None:
    config = _config([{"kind": "service"}])
    with pytest.raises(ValueError, match=r"services\.tools"):
        tool_box_from_config(config)


def test_a_call_time_out_that_is_not_finite_is_refused_even_under_a_deadline(
    servers: tuple[str, str],
) -> None:
    """``timeout_s`` inf or NaN is INVALID_ARGUMENT naming it, with or without the
    caller's own deadline (which used to replace it unchecked)."""
    import grpc

    from rlfleet.common.rpc import create_channel
    from rlfleet.v1 import tools_pb2, tools_pb2_grpc

    address, _ = servers
    with create_channel(address) as channel:
        stub = tools_pb2_grpc.ToolServiceStub(channel)
        for bad in (float("inf"), float("nan")):
            for deadline in (5.0, None):
                request = tools_pb2.CallToolRequest(
                    name="calculator", arguments_json='{"expression": "1+1"}', timeout_s=bad
                )
                with pytest.raises(grpc.RpcError) as e:
                    stub.CallTool(request, timeout=deadline)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "timeout_s" in str(e.value.details())
