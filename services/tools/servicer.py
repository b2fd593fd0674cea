"""ToolService over gRPC: validate, convert, delegate to :class:`ToolCore`.

Errors are raised as :mod:`rlfleet.common.errors` classes and mapped to status codes
by the server's interceptor (unknown tool: ``NOT_FOUND``; arguments that are not a
JSON object, too large, a bad time-out or name: ``INVALID_ARGUMENT``). What a tool
does wrong is an answer (``error`` set), not a status.
"""

from __future__ import annotations

import math

import grpc

from rlfleet.common.errors import InvalidArgument
from rlfleet.tools import serde
from rlfleet.tools.core import ToolCore, check_name
from rlfleet.v1 import tools_pb2, tools_pb2_grpc

__all__ = ["MAX_CALL_ID_CHARS", "ToolServicer"]

MAX_CALL_ID_CHARS = 128


class ToolServicer(tools_pb2_grpc.ToolServiceServicer):
    """Thin adapter; every decision lives in the core."""

    def __init__(self, core: ToolCore) -> None:
        self.core = core

    def ListTools(
        self, request: tools_pb2.ListToolsRequest, context: grpc.ServicerContext
    ) -> tools_pb2.ListToolsResponse:
        return tools_pb2.ListToolsResponse(
            tools=[serde.spec_to_proto(s) for s in self.core.list_tools()]
        )

    def CallTool(
        self, request: tools_pb2.CallToolRequest, context: grpc.ServicerContext
    ) -> tools_pb2.CallToolResponse:
        check_name(request.name)
        if len(request.call_id) > MAX_CALL_ID_CHARS:
            raise InvalidArgument(
                f"call_id has {len(request.call_id)} characters; at most {MAX_CALL_ID_CHARS}",
                field="call_id",
                value=len(request.call_id),
            )
        timeout = request.timeout_s
        if not math.isfinite(timeout):  # refused before a deadline could hide it
            raise InvalidArgument(
                f"timeout_s must be a finite number >= 0 (0: the default), got {timeout}",
                field="timeout_s",
                value=timeout,
            )
        left = context.time_remaining()
        if left is not None and (timeout == 0 or timeout > left):
            # No answer after the caller gave up: stop waiting when it does.
            timeout = max(left, 1e-3)
        result = self.core.call(request.name, request.arguments_json, timeout)
        return serde.result_to_proto(result, request.call_id)
