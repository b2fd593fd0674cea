"""ToolCore: a table of tools, each call checked, bounded and timed. No sockets.

A call goes through the same steps whoever makes it (the gRPC servicer, an
in-process client in a rollout replica):

1. the name must be a tool of the table (``NotFound`` naming the tools there are);
2. the arguments are a JSON object of at most ``max_arguments_bytes`` bytes
   (``InvalidArgument``) that matches the tool's parameter schema (required keys,
   JSON types): a mismatch is the *model's* mistake, answered as a result with
   ``error`` set so the model can read it and try again;
3. the tool runs on the core's thread pool (at most ``max_concurrent_calls`` at
   once) and is waited for up to the call's time-out (the caller's, else
   ``default_timeout_s``, never more than ``max_timeout_s``); a call still queued
   at its time-out never starts, one that runs past it is answered ``timed_out``
   (tools bound their own work: the Python tool's sandbox is killed at the same
   time-out, the calculator bounds its numbers);
4. whatever the tool raises becomes the result's ``error`` (a :class:`ToolError`
   as its message, anything else as ``<type>: <message>``, logged): a failing tool
   never fails the caller; its content is cut to ``max_content_bytes``.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlfleet.common.errors import InvalidArgument, NotFound

__all__ = [
    "NAME_PATTERN",
    "Tool",
    "ToolCore",
    "ToolError",
    "ToolLimits",
    "ToolResult",
    "ToolSpec",
    "check_arguments",
    "check_name",
    "clip_text",
    "parse_arguments",
]

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""What a tool name may be: what every chat template and parser can carry."""

_TRUNCATED = "\n...(truncated)"


@dataclass(frozen=True)
class ToolSpec:
    """What a model is told about a tool.

    Attributes:
        name: matches :data:`NAME_PATTERN`.
        description: one or two sentences for the model.
        parameters: JSON schema of the arguments (``{"type": "object", ...}``).
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI / Hermes ``{"type": "function", "function": {...}}`` form, what
        ``tokenizer.apply_chat_template(..., tools=[...])`` takes."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass
class ToolResult:
    """The answer to one call.

    Attributes:
        content: what the tool produced (stdout, a value, ...).
        error: why the call failed ("" when it did not); content may hold partial
            output.
        timed_out: it ran past its time-out.
        seconds: wall time of the call.
    """

    content: str
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error


class ToolError(Exception):
    """Raised by a tool for a failure the model should read (bad input, its program
    failed); the message is what the model gets."""


@runtime_checkable
class Tool(Protocol):
    """One tool. ``call`` gets checked arguments and the call's time-out, and must
    return within about that time (the core stops waiting then, but cannot stop a
    thread); it raises :class:`ToolError` for failures the model should see."""

    @property
    def spec(self) -> ToolSpec: ...

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str: ...


@dataclass(frozen=True)
class ToolLimits:
    """What one call may ask of a :class:`ToolCore`.

    Attributes:
        default_timeout_s: a call's time-out when the caller gives none.
        max_timeout_s: the most a caller may ask for.
        max_concurrent_calls: tools running at once; more calls queue (their wait
            counts against their time-out).
        max_arguments_bytes: size of a call's arguments JSON.
        max_content_bytes: a result's content is cut to this (UTF-8 bytes).
    """

    default_timeout_s: float = 10.0
    max_timeout_s: float = 60.0
    max_concurrent_calls: int = 16
    max_arguments_bytes: int = 64 << 10
    max_content_bytes: int = 16 << 10

    def __post_init__(self) -> None:
        bad = []
        for name in ("default_timeout_s", "max_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and 0 < v < math.inf):
                bad.append(f"{name}={v!r} (a positive number)")
        for name in ("max_concurrent_calls", "max_arguments_bytes", "max_content_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad.append(f"{name}={v!r} (an integer >= 1)")
        if not bad and self.default_timeout_s > self.max_timeout_s:
            bad.append(
                f"default_timeout_s={self.default_timeout_s} > max_timeout_s={self.max_timeout_s}"
            )
        if bad:
            raise ValueError("tool limits: " + "; ".join(bad))

    def timeout(self, asked: float) -> float:
        """The time-out of a call that asked for ``asked`` seconds (0: the default).

        Raises:
            InvalidArgument: ``asked`` is negative or not finite.
        """
        if not math.isfinite(asked) or asked < 0:
            raise InvalidArgument(
                f"must be a finite number >= 0 (0: the default), got {asked}",
                field="timeout_s",
                value=asked,
            )
        return min(asked or self.default_timeout_s, self.max_timeout_s)


def check_name(name: str, field_name: str = "name") -> str:
    """``name`` if it matches :data:`NAME_PATTERN`, else ``InvalidArgument``."""
    if not NAME_PATTERN.match(name):
        raise InvalidArgument(
            "a tool name is 1 to 64 characters of A-Z a-z 0-9 _ . -",
            field=field_name,
            value=name[:80],
        )
    return name


def parse_arguments(text: str, max_bytes: int) -> dict[str, Any]:
    """A call's arguments JSON as a dict ("" is ``{}``).

    Raises:
        InvalidArgument: over ``max_bytes`` (``LIMIT_EXCEEDED``), not JSON, or not
            an object.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidArgument(
            f"arguments of {size} bytes exceed the limit of {max_bytes}",
            field="arguments_json",
            value=size,
            code="LIMIT_EXCEEDED",
        )
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(
            f"arguments are not valid JSON: {e}", field="arguments_json", code="BAD_JSON"
        ) from e
    if not isinstance(value, dict):
        raise InvalidArgument(
            f"arguments must be a JSON object, got {type(value).__name__}",
            field="arguments_json",
            code="BAD_JSON",
        )
    return value


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _is_type(value: Any, kind: str) -> bool:
    types = _JSON_TYPES.get(kind)
    if types is None:  # a type this checker does not know: not checked
        return True
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, types)


def check_arguments(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    """Check ``arguments`` against the top level of an object schema: required keys
    present, each known property of its JSON ``type``, no unknown key when
    ``additionalProperties`` is false. (Nested schemas are the tool's to check.)

    Raises:
        ToolError: naming the argument and what was expected.
    """
    props: Mapping[str, Any] = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or () if k not in arguments]
    if missing:
        raise ToolError(f"missing required argument(s): {', '.join(map(str, missing))}")
    if schema.get("additionalProperties") is False:
        extra = [k for k in arguments if k not in props]
        if extra:
            raise ToolError(
                f"unknown argument(s): {', '.join(extra[:5])}; expected {', '.join(props)}"
            )
    for key, value in arguments.items():
        want = (props.get(key) or {}).get("type")
        if want is None:
            continue
        kinds = want if isinstance(want, list) else [want]
        if not any(_is_type(value, str(k)) for k in kinds):
            got = "null" if value is None else type(value).__name__
            raise ToolError(f"argument {key!r} must be of type {'/'.join(kinds)}, got {got}")


def clip_text(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes, marked when cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    keep = max(0, max_bytes - len(_TRUNCATED))
    return raw[:keep].decode("utf-8", "ignore") + _TRUNCATED


def _call_within(tool: Tool, arguments: Mapping[str, Any], deadline: float) -> str:
    """Run ``tool`` with what is left of its call's time-out when a worker takes it
    (a call that waited in the queue does not get its whole time-out again)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ToolError("timed out in the queue")
    return tool.call(arguments, left)


class ToolCore:
    """The tools one process serves (see the module docstring).

    Args:
        tools: the tools; names must be unique.
        limits: bounds of each call.
    """

    def __init__(self, tools: Sequence[Tool], limits: ToolLimits | None = None) -> None:
        self.limits = limits or ToolLimits()
        self._tools: dict[str, Tool] = {}
        for t in tools:
            name = check_name(t.spec.name, "tools[].name")
            if name in self._tools:
                raise ValueError(f"two tools are named {name!r}")
            self._tools[name] = t
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.limits.max_concurrent_calls, thread_name_prefix="rlfleet-tool"
        )
        self._lock = threading.Lock()
        self._closed = False
        self.calls_total = 0
        self.errors_total = 0
        self.timeouts_total = 0

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def list_tools(self) -> list[ToolSpec]:
        return [t.spec for t in self._tools.values()]

    def tools(self) -> list[Tool]:
        """The tool objects, in the order they were given."""
        return list(self._tools.values())

    def call(self, name: str, arguments_json: str, timeout_s: float = 0.0) -> ToolResult:
        """Run one call (see the module docstring).

        Raises:
            NotFound: no tool ``name``.
            InvalidArgument: arguments not a JSON object or too large; a bad time-out.
        """
        tool = self._tools.get(name)
        if tool is None:
            raise NotFound(
                f"no tool {name[:80]!r}; this service has {', '.join(self._tools) or 'none'}",
                field="name",
                value=name[:80],
                code="UNKNOWN_TOOL",
            )
        timeout = self.limits.timeout(timeout_s)
        arguments = parse_arguments(arguments_json, self.limits.max_arguments_bytes)
        t0 = time.perf_counter()
        try:
            check_arguments(tool.spec.parameters, arguments)
        except ToolError as e:
            return self._done(ToolResult("", error=str(e)), t0)
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool core is closed")
            deadline = time.monotonic() + timeout
            future = self._pool.submit(_call_within, tool, arguments, deadline)
        try:
            content = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # still queued: never starts
            return self._done(
                ToolResult("", error=f"timed out after {timeout:g}s", timed_out=True), t0
            )
        except ToolError as e:
            return self._done(ToolResult("", error=str(e) or type(e).__name__), t0)
        except Exception as e:  # a crashing tool answers the model, never the caller
            logger.warning("tool %s crashed: %s: %s", name, type(e).__name__, e, exc_info=True)
            return self._done(ToolResult("", error=f"{type(e).__name__}: {e}"), t0)
        if not isinstance(content, str):
            return self._done(
                ToolResult("", error=f"the tool returned {type(content).__name__}, not text"), t0
            )
        return self._done(ToolResult(content), t0)

    def _done(self, result: ToolResult, t0: float) -> ToolResult:
        result.seconds = time.perf_counter() - t0
        lim = self.limits.max_content_bytes
        result.content = clip_text(result.content, lim)
        result.error = clip_text(result.error, lim)
        with self._lock:
            self.calls_total += 1
            self.errors_total += 0 if result.ok else 1
            self.timeouts_total += 1 if result.timed_out else 0
        return result

    def close(self) -> None:
        """Stop taking calls; running tools finish on their own."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ToolCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
