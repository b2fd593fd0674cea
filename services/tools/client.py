"""Tool clients: one interface, in-process, over gRPC, or an HTTP endpoint.

::

    client = RemoteToolClient("127.0.0.1:50070")        # a ToolService
    client = InProcessToolClient(ToolCore([Calculator()]))
    client = HttpToolClient("http://127.0.0.1:8000/search", spec)   # POST JSON
    client.list_tools()                                  # [ToolSpec, ...]
    client.call("calculator", '{"expression": "6 * 7"}', timeout_s=5)   # ToolResult("42")

Every implementation answers a failing *tool* with a :class:`ToolResult` whose
``error`` is set, and raises :mod:`rlfleet.common.errors` classes for a call that
could not be made (unknown tool, bad arguments, the service unreachable or past
the deadline); the multi-turn rollout turns either into an error message for the
model.

**HTTP tools** speak a minimal JSON protocol: the client POSTs
``{"name": ..., "arguments": {...}}`` to the URL and reads a JSON object back,
``{"content": "..."}`` or ``{"error": "..."}`` (any other status than 200, or a
body that is not such an object, is an error result). Redirects are not followed,
the answer is read up to ``max_response_bytes``, and no rlfleet credential is sent
(the endpoint is not an rlfleet service).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Protocol

import grpc

from rlfleet.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from rlfleet.common.rpc import DEFAULT_TIMEOUT_S, create_channel, to_rlfleet_error
from rlfleet.tools import serde
from rlfleet.tools.core import ToolCore, ToolResult, ToolSpec, check_name, clip_text
from rlfleet.v1 import tools_pb2, tools_pb2_grpc

__all__ = [
    "DEADLINE_GRACE_S",
    "HttpToolClient",
    "InProcessToolClient",
    "RemoteToolClient",
    "ToolClient",
]

DEADLINE_GRACE_S = 2.0
"""A remote call's gRPC deadline is its time-out plus this: the service answers a
time-out itself, the deadline only catches a service that does not answer."""


class ToolClient(Protocol):
    """What a multi-turn rollout uses to reach tools."""

    def list_tools(self) -> list[ToolSpec]: ...

    def call(
        self, name: str, arguments_json: str, *, timeout_s: float, call_id: str = ""
    ) -> ToolResult: ...

    def close(self) -> None: ...


class InProcessToolClient:
    """Calls a :class:`ToolCore` in this process."""

    def __init__(self, core: ToolCore, *, own: bool = False) -> None:
        self.core = core
        self._own = own

    def list_tools(self) -> list[ToolSpec]:
        return self.core.list_tools()

    def call(
        self, name: str, arguments_json: str, *, timeout_s: float, call_id: str = ""
    ) -> ToolResult:
        return self.core.call(name, arguments_json, timeout_s)

    def close(self) -> None:
        if self._own:
            self.core.close()


class RemoteToolClient:
    """Talks to a ``ToolService`` over gRPC (authenticated with this process's
    credentials, or ``auth_token``)."""

    def __init__(
        self,
        address: str | grpc.Channel,
        *,
        auth_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.address = address if isinstance(address, str) else "<channel>"
        if isinstance(address, str):
            self.channel = create_channel(address, auth_token=auth_token)
            self._own = True
        else:
            self.channel = address
            self._own = False
        self.stub = tools_pb2_grpc.ToolServiceStub(self.channel)
        self._timeout_s = timeout_s

    def list_tools(self) -> list[ToolSpec]:
        try:
            msg = self.stub.ListTools(tools_pb2.ListToolsRequest(), timeout=self._timeout_s)
        except grpc.RpcError as e:
            raise to_rlfleet_error(e) from e
        return [serde.spec_from_proto(t) for t in msg.tools]

    def call(
        self, name: str, arguments_json: str, *, timeout_s: float, call_id: str = ""
    ) -> ToolResult:
        request = tools_pb2.CallToolRequest(
            name=name, arguments_json=arguments_json, timeout_s=timeout_s, call_id=call_id
        )
        try:
            msg = self.stub.CallTool(request, timeout=timeout_s + DEADLINE_GRACE_S)
        except grpc.RpcError as e:
            err = to_rlfleet_error(e)
            raise type(err)(
                f"tool service {self.address}: {err.message}",
                field=err.field,
                value=err.value,
                code=err.code,
                recoverable=err.recoverable,
            ) from e
        return serde.result_from_proto(msg)

    def close(self) -> None:
        if self._own:
            self.channel.close()

    def __enter__(self) -> RemoteToolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _read_until(response: Any, limit: int, deadline: float) -> bytes:
    """Up to ``limit`` bytes of ``response``, read as they come, stopping at
    ``deadline`` (a server that drips its answer does not hold the call past its
    time-out; each read waits at most the socket's time-out, the call's).

    Raises:
        TimeoutError: the deadline passed before the answer ended.
    """
    parts: list[bytes] = []
    got = 0
    while got < limit:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer did not end in time")
        part = response.read1(min(1 << 16, limit - got))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _unicode(text: str) -> str:
    """``text`` with lone surrogates (``"\\ud83d"`` in JSON decodes to one) replaced:
    what goes into the model's context must encode as UTF-8."""
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


class HttpToolClient:
    """One tool behind an HTTP endpoint (the protocol is in the module docstring).

    Args:
        url: ``http://`` or ``https://`` URL the calls are POSTed to.
        spec: what the model is told about the tool (its name is the one called).
        max_response_bytes: the answer is read up to this; a longer one is an error.
    """

    def __init__(self, url: str, spec: ToolSpec, *, max_response_bytes: int = 1 << 20) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(
                "an HTTP tool's address must be an http:// or https:// URL",
                field="address",
                value=url,
            )
        check_name(spec.name)
        self.url = url
        self.spec = spec
        self.max_response_bytes = max_response_bytes
        # No redirects, and no HTTP(S)_PROXY from the environment: calls go to the URL.
        self._opener = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}))

    def list_tools(self) -> list[ToolSpec]:
        return [self.spec]

    def call(
        self, name: str, arguments_json: str, *, timeout_s: float, call_id: str = ""
    ) -> ToolResult:
        if name != self.spec.name:
            raise InvalidArgument(
                f"this endpoint serves {self.spec.name!r}, not {name[:64]!r}", field="name"
            )
        try:
            arguments = json.loads(arguments_json or "{}")
        except ValueError as e:
            raise InvalidArgument(
                f"arguments are not valid JSON: {e}", field="arguments_json"
            ) from e
        body = json.dumps({"name": name, "arguments": arguments}).encode()
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        try:
            with self._opener.open(request, timeout=timeout_s) as r:
                raw = _read_until(r, self.max_response_bytes + 1, deadline)
        except urllib.error.HTTPError as e:
            detail = e.read(2048).decode("utf-8", "replace")
            return ToolResult(
                "", error=f"HTTP {e.code}: {detail}", seconds=time.perf_counter() - t0
            )
        except TimeoutError as e:
            raise DeadlineExceeded(f"HTTP tool {self.url}: no answer in {timeout_s:g}s") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise DeadlineExceeded(f"HTTP tool {self.url}: no answer in {timeout_s:g}s") from e
            raise Unavailable(f"HTTP tool {self.url}: {reason}") from e
        seconds = time.perf_counter() - t0
        if len(raw) > self.max_response_bytes:
            return ToolResult(
                "", error=f"the answer exceeds {self.max_response_bytes} bytes", seconds=seconds
            )
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not isinstance(
            value.get("content", value.get("error")), str
        ):
            return ToolResult(
                "",
                error='the answer is not a JSON object {"content": ...} or {"error": ...}: '
                + clip_text(raw.decode("utf-8", "replace"), 200),
                seconds=seconds,
            )
        return ToolResult(
            _unicode(str(value.get("content", ""))),
            error=_unicode(str(value.get("error") or "")),
            seconds=seconds,
        )

    def close(self) -> None:
        pass
