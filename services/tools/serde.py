"""Protobuf <-> tool dataclasses, in one place (servicer and remote client)."""

from __future__ import annotations

import json
from typing import Any

from rlfleet.common.errors import InvalidArgument
from rlfleet.tools.core import ToolResult, ToolSpec
from rlfleet.v1 import tools_pb2

__all__ = ["result_from_proto", "result_to_proto", "spec_from_proto", "spec_to_proto"]

MAX_SCHEMA_BYTES = 64 << 10
"""A tool's parameter schema, as JSON, at most this many bytes (a client lists tools
of services it does not control)."""


def spec_to_proto(s: ToolSpec) -> tools_pb2.ToolSpec:
    return tools_pb2.ToolSpec(
        name=s.name,
        description=s.description,
        parameters_json=json.dumps(dict(s.parameters), sort_keys=True),
    )


def spec_from_proto(msg: tools_pb2.ToolSpec) -> ToolSpec:
    """Raises ``InvalidArgument`` for a schema that is not a JSON object or too large."""
    text = msg.parameters_json or "{}"
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidArgument(
            f"the parameter schema of tool {msg.name[:64]!r} has {len(text)} characters; at "
            f"most {MAX_SCHEMA_BYTES}",
            field="parameters_json",
            code="LIMIT_EXCEEDED",
        )
    try:
        params: Any = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(
            f"tool {msg.name[:64]!r}: its parameter schema is not JSON: {e}",
            field="parameters_json",
        ) from e
    if not isinstance(params, dict):
        raise InvalidArgument(
            f"tool {msg.name[:64]!r}: its parameter schema must be a JSON object",
            field="parameters_json",
        )
    return ToolSpec(msg.name, msg.description, params)


def result_to_proto(r: ToolResult, call_id: str = "") -> tools_pb2.CallToolResponse:
    return tools_pb2.CallToolResponse(
        content=r.content,
        error=r.error,
        timed_out=r.timed_out,
        seconds=r.seconds,
        call_id=call_id,
    )


def result_from_proto(msg: tools_pb2.CallToolResponse) -> ToolResult:
    return ToolResult(
        content=msg.content, error=msg.error, timed_out=msg.timed_out, seconds=msg.seconds
    )
