"""The OpenAI-compatible endpoint of a rollout replica (``rlfleet serve rollout --openai-port P``).

Any agent framework that speaks OpenAI's API can drive rollouts::

    from openai import OpenAI
    client = OpenAI(base_url=openai_url, api_key=open("secrets/agent.token").read())
    out = client.chat.completions.create(
        model="policy", messages=[...], tools=[...], extra_headers={"X-Session-Id": "task-7-a"})
    # ... more turns of the same session ...
    httpx.post(f"{openai_url}/sessions/task-7-a/reward", json={"reward": 1.0, "group": "task-7"},
               headers={"Authorization": f"Bearer {key}"})

Routes (all JSON, all authenticated):

* ``POST /v1/chat/completions``: ``messages`` rendered with the replica tokenizer's
  chat template (``tools`` passed to it; a template that ignores tools gets them as
  a Hermes/Qwen system block, and assistant ``tool_calls`` / ``tool`` results in the
  same format); Hermes ``<tool_call>{json}</tool_call>`` blocks in the output become
  ``message.tool_calls`` with ``finish_reason: tool_calls``.
* ``POST /v1/completions``: ``prompt`` as text, token ids, or a list of either.
* ``GET /v1/models``: the one model served.
* ``POST /v1/sessions/{id}/reward`` (``{"reward": r}``, required) and
  ``POST /v1/sessions/{id}/finish`` (``reward`` optional: the driver's reward function
  then scores the final text): end a session; optional ``group`` (sessions of one
  task, for GRPO-style estimators), ``data_source``, ``ground_truth`` strings.

Both generation routes take ``n``, ``max_tokens`` (chat: or ``max_completion_tokens``),
``temperature`` (default 1; below 0.01 is greedy), ``top_p``, ``top_k`` (vLLM's
extension), ``seed``, ``stop`` (strings; a stop string of one token also stops the
engine there), ``logprobs`` (chat: ``top_logprobs`` 0 only; completions: ``logprobs``
0 only: the sampled tokens' log-probs, no alternatives), ``stream`` with
``stream_options.include_usage``. Penalties, ``logit_bias``, ``response_format`` other
than text, ``tool_choice`` other than ``auto``/``none``, ``echo``, ``suffix`` and
``best_of`` other than ``n`` are refused (400) rather than ignored.

**Streaming** sends Server-Sent Events and ends with ``data: [DONE]``; the engine
returns whole samples, so each choice arrives as one content chunk and one finish
chunk, as soon as that choice finished (not token by token).

**Sessions.** A request's session id is the ``X-Session-Id`` header, else
``metadata.session_id``, else ``user``; without any, one is generated. It is returned
in the ``X-Session-Id`` response header and the body's ``session_id``. Every choice
returned is recorded in the replica's :class:`~rlfleet.rollout.trajectories.TrajectoryStore`
under that id, exactly as returned: prompt token ids, sampled token ids (cut after a
stop string, as the text is), their log-probs and the weight version. Responses carry
``weight_version`` too.

**Bounds.** Bearer token of a role in ``OPENAI_ENDPOINT_ROLES`` (``agent``, ``driver``)
unless the replica runs ``--insecure`` (loopback only); request bodies up to
``max_body_bytes`` (413 beyond), ``n`` / ``max_tokens`` / prompt sizes within the
replica's :class:`~rlfleet.rollout.engine.GenerateLimits` (the gRPC edge's), a request
within the trajectory store's token bound, connections up to ``max_connections``, a
request's generation within ``request_timeout_s`` (504, the generation is cancelled),
an idle connection closed after ``idle_timeout_s``. Errors are OpenAI's JSON
(``{"error": {"message", "type", "param", "code"}}``).

Requests go through the replica's :class:`~rlfleet.rollout.core.RolloutCore`: they are
batched with gRPC ``Generate`` calls, on the same weights and versions.

This module is the endpoint without sockets (:class:`OpenAIFrontend`: parse, validate,
generate, record, format); :mod:`rlfleet.rollout.openai_server` serves it over HTTP and
:mod:`rlfleet.rollout.chat_format` renders chats and parses tool calls.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RlfleetError,
    Unavailable,
)
from rlfleet.rollout.chat_format import parse_tool_calls, render_chat
from rlfleet.rollout.core import RolloutCore
from rlfleet.rollout.engine import MIN_TEMPERATURE, FinishReason, SampleOutput, SamplingParams
from rlfleet.rollout.trajectories import Completion, TrajectoryStore

__all__ = [
    "SESSION_HEADER",
    "ApiError",
    "Choice",
    "OpenAIFrontend",
    "OpenAIOptions",
    "Prepared",
    "parse_body",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_IDLE_TIMEOUT_S = 30.0

MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_SESSION_ID_CHARS = 128
MAX_INFO_CHARS = 4096
MAX_METADATA_KEYS = 16
MAX_JSON_DEPTH = 64

SESSION_HEADER = "X-Session-Id"
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _error_type(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _error_type(status: int) -> str:
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "conflict_error",
        504: "timeout_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


@dataclass(frozen=True)
class OpenAIOptions:
    """How the endpoint is bounded (see the module docstring).

    Attributes:
        model_name: the id ``/v1/models`` lists and responses name; None: the engine's.
        max_body_bytes: request body size at most (413 beyond).
        max_connections: connections handled at once; more are closed at once.
        request_timeout_s: a request's generation at most (504 beyond, cancelled).
        idle_timeout_s: a connection silent this long (between or within requests)
            is closed.
    """

    model_name: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        bad = [
            f"{k}={getattr(self, k)}"
            for k in ("max_body_bytes", "max_connections", "request_timeout_s", "idle_timeout_s")
            if not getattr(self, k) > 0
        ]
        if bad:
            raise ValueError(f"OpenAI endpoint options must be > 0: {', '.join(bad)}")


# --------------------------------------------------------------------------- validation


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_ABS_REWARD = 1e6
"""The largest reward an agent may post (either sign): rewards train in float32, where
1e308 is infinity, and anything near such a size would swamp every advantage."""


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def _opt_int(
    body: Mapping[str, Any], key: str, lo: int, hi: int, default: int | None
) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise ApiError(400, f"{key} must be an integer, got {v!r}", param=key)
    if not lo <= v <= hi:
        raise ApiError(
            400, f"{key} must be in [{lo}, {hi}], got {v}", param=key, code="invalid_value"
        )
    return int(v)


def _opt_number(body: Mapping[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise ApiError(400, f"{key} must be a finite number, got {v!r}", param=key)
    if not lo <= v <= hi:
        raise ApiError(
            400, f"{key} must be in [{lo}, {hi}], got {v}", param=key, code="invalid_value"
        )
    return float(v)


def _opt_bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be a boolean, got {v!r}", param=key)
    return v


def _opt_str(body: Mapping[str, Any], key: str, limit: int) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ApiError(400, f"{key} must be a string, got {type(v).__name__}", param=key)
    if len(v) > limit:
        raise ApiError(400, f"{key} is {len(v)} characters, at most {limit}", param=key)
    return v


def _refuse_unless_default(body: Mapping[str, Any], key: str, ok: Any, why: str) -> None:
    v = body.get(key)
    if v is None or v == ok or (isinstance(ok, tuple) and v in ok):
        return
    raise ApiError(400, f"{key}={v!r} is not supported by this endpoint: {why}", param=key)


def _session_id(value: Any, where: str) -> str:
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_SESSION_ID_CHARS
        or not value.isascii()
        or not value.isprintable()
        or any(c.isspace() for c in value)
        or "/" in value
    ):
        raise ApiError(
            400,
            f"a session id is 1 to {MAX_SESSION_ID_CHARS} printable ASCII characters without "
            f"spaces or '/', got {str(value)[:80]!r}",
            param=where,
        )
    return value


def _json_problem(v: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """What makes ``v`` unusable, or None: nesting deeper than ``limit``, or a string
    (a value or a key) with a lone surrogate (``"\\ud800"`` decodes to one; it cannot
    be encoded as UTF-8 again, for a tokenizer or a protobuf). Iterative: no recursion."""
    stack = [(v, 0)]
    while stack:
        x, d = stack.pop()
        if d > limit:
            return f"the body nests deeper than {limit} levels"
        if isinstance(x, str):
            if not x.isascii():
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError:
                    return "the body has a string with a lone surrogate (not valid Unicode)"
        elif isinstance(x, dict):
            stack.extend((y, d + 1) for y in x.values())
            stack.extend((k, d + 1) for k in x)
        elif isinstance(x, list):
            stack.extend((y, d + 1) for y in x)
    return None


def _token_ids(ids: list[Any]) -> list[int]:
    """A prompt's token ids, each in [0, 2^31) (an id beyond the model's vocabulary is
    the engine's 400; one beyond any integer type is this one)."""
    out = [int(x) for x in ids]
    bad = next((t for t in out if not 0 <= t < 2**31), None)
    if bad is not None:
        raise ApiError(400, f"prompt: token id {bad} is not in [0, 2^31)", param="prompt")
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object; NaN/Infinity, deep nesting, lone surrogates and
    non-objects are 400s."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    problem = _json_problem(body)
    if problem is not None:
        raise ApiError(400, problem)
    return body


# --------------------------------------------------------------------------- the frontend


@dataclass
class Prepared:
    """A validated generation request."""

    kind: str  # "chat" | "completion"
    session_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Choice:
    """One returned choice, exactly as recorded."""

    index: int
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_version: int
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class OpenAIFrontend:
    """Parses OpenAI requests, generates through the core, records, formats. No sockets.

    Args:
        core: the replica's batching core (limits: ``core.limits``).
        tokenizer: the model's tokenizer (chat template, encode, decode).
        store: where every returned choice is recorded.
        options: bounds and the served model name.
    """

    def __init__(
        self,
        core: RolloutCore,
        tokenizer: Any,
        store: TrajectoryStore,
        options: OpenAIOptions | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.store = store
        self.options = options or OpenAIOptions()
        info = core.info()
        self.model_name = self.options.model_name or info.model
        self.max_model_len = info.max_model_len
        self.created = int(time.time())
        # Fast tokenizers are not safe to share between threads in every version.
        self._tok_lock = threading.Lock()

    # ------------------------------------------------------------------ tokenizer

    def _decode(self, ids: Sequence[int]) -> str:
        with self._tok_lock:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _token_texts(self, ids: Sequence[int]) -> list[str]:
        with self._tok_lock:
            return [str(t) for t in self.tokenizer.batch_decode([[i] for i in ids])]

    def _encode(self, text: str) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=True))

    def _single_token(self, text: str) -> int | None:
        with self._tok_lock:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 else None

    # ------------------------------------------------------------------ parsing

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "rlfleet",
                    "max_model_len": self.max_model_len,
                    "weight_version": self.core.info().weight_version,
                }
            ],
        }

    def session_of(self, body: Mapping[str, Any], header: str | None) -> str:
        """The request's session id (header, ``metadata.session_id``, ``user``), or a new one."""
        if header is not None:
            return _session_id(header, SESSION_HEADER)
        meta = body.get("metadata")
        if meta is not None:
            if not isinstance(meta, dict) or len(meta) > MAX_METADATA_KEYS:
                raise ApiError(
                    400,
                    f"metadata must be an object of at most {MAX_METADATA_KEYS} string values",
                    param="metadata",
                )
            for k, v in meta.items():
                if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
                    raise ApiError(
                        400,
                        "metadata keys are up to 64 characters, values strings up to 512",
                        param=f"metadata.{k[:64]}",
                    )
            if "session_id" in meta:
                return _session_id(meta["session_id"], "metadata.session_id")
        user = body.get("user")
        if user is not None:
            return _session_id(user, "user")
        return f"s-{uuid.uuid4().hex}"

    def parse_messages(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        if len(msgs) > MAX_MESSAGES:
            raise ApiError(400, f"{len(msgs)} messages, at most {MAX_MESSAGES}", param="messages")
        out = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise ApiError(400, f"{where} must be an object", param=where)
            role = m.get("role")
            if role not in _ROLES:
                raise ApiError(
                    400, f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}",
                    param=f"{where}.role",
                )  # fmt: skip
            content = _content_text(m.get("content"), f"{where}.content")
            msg: dict[str, Any] = {
                "role": "system" if role == "developer" else role,
                "content": content,
            }
            calls = m.get("tool_calls")
            if calls is not None:
                if role != "assistant":
                    raise ApiError(400, "only assistant messages carry tool_calls",
                                   param=f"{where}.tool_calls")  # fmt: skip
                msg["tool_calls"] = _tool_calls_in(calls, f"{where}.tool_calls")
            if role == "tool":
                tid = m.get("tool_call_id")
                if tid is not None and not isinstance(tid, str):
                    raise ApiError(400, "tool_call_id must be a string",
                                   param=f"{where}.tool_call_id")  # fmt: skip
                if tid is not None:
                    msg["tool_call_id"] = tid
            name = m.get("name")
            if isinstance(name, str):
                msg["name"] = name
            out.append(msg)
        return out

    def parse_tools(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
        """``(tools, parse their calls in the output)``."""
        for legacy in ("functions", "function_call"):
            if body.get(legacy) is not None:
                raise ApiError(400, f"{legacy} is not supported: use tools", param=legacy)
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if choice is not None and choice not in ("auto", "none"):
            raise ApiError(
                400,
                f"tool_choice {choice!r} is not supported (no constrained decoding): use "
                "'auto' or 'none'",
                param="tool_choice",
            )
        if tools is None:
            return None, False
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS}", param="tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                raise ApiError(400, 'each tool must be {"type": "function", "function": {...}}',
                               param=f"tools[{i}]")  # fmt: skip
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.match(name):
                raise ApiError(400, "a function name is 1 to 64 of [A-Za-z0-9_.-]",
                               param=f"tools[{i}].function.name")  # fmt: skip
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise ApiError(400, "parameters must be a JSON schema object",
                               param=f"tools[{i}].function.parameters")  # fmt: skip
        return (tools or None), bool(tools) and choice != "none"

    def _sampling(
        self, body: Mapping[str, Any], prompts: list[list[int]], kind: str
    ) -> tuple[SamplingParams, tuple[str, ...]]:
        limits = self.core.limits
        n = _opt_int(body, "n", 1, limits.max_n, 1)
        assert n is not None
        best_of = body.get("best_of")
        if best_of is not None and best_of != n:
            raise ApiError(400, "best_of other than n is not supported", param="best_of")
        key = "max_tokens"
        max_tokens = _opt_int(body, "max_tokens", 1, limits.max_new_tokens, None)
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
            max_tokens = _opt_int(body, key, 1, limits.max_new_tokens, None)
        longest = max(len(p) for p in prompts)
        room = self.max_model_len - longest
        if room < 1:
            raise ApiError(
                400,
                f"the prompt is {longest} tokens: no room left in the model's context of "
                f"{self.max_model_len}",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(room, limits.max_new_tokens)
        elif max_tokens > room:
            raise ApiError(
                400,
                f"prompt of {longest} tokens + {key} {max_tokens} exceeds the model's context "
                f"of {self.max_model_len} tokens",
                param=key,
                code="context_length_exceeded",
            )
        temperature = _opt_number(body, "temperature", 0.0, 2.0, 1.0)
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0  # the engine samples greedily below MIN_TEMPERATURE
        top_p = _opt_number(body, "top_p", 0.0, 1.0, 1.0)
        if top_p == 0.0:
            raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
        top_k = _opt_int(body, "top_k", -1, 1 << 30, -1)
        seed = _opt_int(body, "seed", -(1 << 63), (1 << 63) - 1, None)
        stop = _stops(body.get("stop"))
        stop_ids = tuple(sorted({t for s in stop if (t := self._single_token(s)) is not None}))
        for key, ok, why in (
            ("presence_penalty", (0, 0.0), "no penalties"),
            ("frequency_penalty", (0, 0.0), "no penalties"),
            ("repetition_penalty", (1, 1.0), "no penalties"),
            ("logit_bias", {}, "no logit bias"),
            ("response_format", {"type": "text"}, "no structured output"),
        ):
            _refuse_unless_default(body, key, ok, why)
        try:
            params = SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k is not None and top_k > 0 else -1,
                max_tokens=max_tokens,
                stop_token_ids=stop_ids,
                seed=seed,
                logprobs=True,  # always: the trajectory records them
            )
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        tokens = n * sum(len(p) + max_tokens for p in prompts)
        if tokens > self.store.max_tokens:
            raise ApiError(
                400,
                f"n x (prompt + max_tokens) = {tokens} tokens exceeds this replica's trajectory "
                f"store ({self.store.max_tokens} tokens)",
                param="max_tokens",
                code="limit_exceeded",
            )
        return params, stop

    def prepare(self, kind: str, body: Mapping[str, Any], session_header: str | None) -> Prepared:
        """Validate a chat (``kind="chat"``) or completions request; raises :class:`ApiError`."""
        model = _opt_str(body, "model", 256)
        del model  # one model per replica: any name is served by it
        session = self.session_of(body, session_header)
        stream = _opt_bool(body, "stream")
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        include_usage = bool(stream and so and so.get("include_usage") is True)
        tools: list[dict[str, Any]] | None = None
        parse = False
        if kind == "chat":
            messages = self.parse_messages(body)
            tools, parse = self.parse_tools(body)
            logprobs = _opt_bool(body, "logprobs")
            top = _opt_int(body, "top_logprobs", 0, 20, 0)
            if top:
                raise ApiError(
                    400,
                    "top_logprobs > 0 is not supported: the replica returns the sampled "
                    "tokens' log-probs only",
                    param="top_logprobs",
                )
            try:
                with self._tok_lock:
                    prompts = [render_chat(self.tokenizer, messages, tools)]
            except Exception as e:  # the template's own error (jinja raise_exception)
                raise ApiError(400, f"the chat template refused the messages: {e}",
                               param="messages") from None  # fmt: skip
        else:
            prompts = self._prompts(body.get("prompt"))
            lp = body.get("logprobs")
            if lp is not None and (not _is_int(lp) or lp != 0):
                raise ApiError(
                    400,
                    "logprobs must be 0 (the sampled tokens' log-probs; no alternatives are "
                    f"returned), got {lp!r}",
                    param="logprobs",
                )
            logprobs = lp is not None
            _refuse_unless_default(body, "echo", False, "no echo")
            _refuse_unless_default(body, "suffix", "", "no suffix")
        if len(prompts) > self.core.limits.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts, at most {self.core.limits.max_prompts}",
                           param="prompt")  # fmt: skip
        if any(len(p) == 0 for p in prompts):
            raise ApiError(400, "a prompt has no tokens",
                           param="messages" if kind == "chat" else "prompt")  # fmt: skip
        params, stop = self._sampling(body, prompts, kind)
        if self.store.state(session) == "finished":
            raise ApiError(
                409,
                f"session {session!r} is finished: start a new session for more turns",
                param="session_id",
                code="session_finished",
            )
        return Prepared(
            kind=kind,
            session_id=session,
            prompts=prompts,
            params=params,
            stop=stop,
            logprobs=logprobs,
            tools=tools,
            parse_tools=parse,
            stream=stream,
            include_usage=include_usage,
        )

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(_is_int(x) for x in prompt):
                return [_token_ids(prompt)]
            if all(isinstance(x, str) for x in prompt):
                return [self._encode(x) for x in prompt]
            if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in prompt):
                return [_token_ids(x) for x in prompt]
        raise ApiError(
            400,
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            param="prompt",
        )

    # ------------------------------------------------------------------ generation

    def generate(
        self, prep: Prepared, *, on_submit: Callable[[Callable[[], None]], None] | None = None
    ) -> Generator[Choice, None, None]:
        """Choices as they finish; each is recorded in the store before it is yielded's
        caller sees the next. Raises :class:`ApiError` (504 at the time-out, 400 for
        what the core's checks refuse, 503 when the core is shutting down or the
        generation was cancelled).

        ``on_submit`` gets the generation's cancel function once it is queued (the
        HTTP handler cancels when its client goes away)."""
        try:
            handle = self.core.submit(prep.prompts, prep.params)
        except InvalidArgument as e:
            raise _api_error(e, prep.kind) from None
        except (Unavailable, FailedPrecondition) as e:
            raise _unavailable(e) from None
        if on_submit is not None:
            on_submit(handle.cancel)
        fired = threading.Event()

        def expire() -> None:
            fired.set()
            handle.cancel()

        timer = threading.Timer(self.options.request_timeout_s, expire)
        timer.daemon = True
        timer.start()
        got = 0
        try:
            for sample in handle:
                got += 1
                yield self._choice(prep, sample)
        except InvalidArgument as e:
            raise _api_error(e, prep.kind) from None
        except (Unavailable, FailedPrecondition) as e:
            raise _unavailable(e) from None
        finally:
            timer.cancel()
            handle.cancel()
        if got < handle.samples:
            if fired.is_set():
                raise ApiError(
                    504,
                    f"generation took longer than {self.options.request_timeout_s:g}s: cancelled",
                    code="timeout",
                )
            raise ApiError(503, "the generation was cancelled", code="cancelled")

    def record(self, prep: Prepared, choice: Choice) -> None:
        try:
            self._record(prep, choice)
        except FailedPrecondition as e:  # finished by a concurrent call meanwhile
            raise ApiError(409, e.message, param="session_id", code="session_finished") from None

    def _record(self, prep: Prepared, choice: Choice) -> None:
        self.store.record(
            prep.session_id,
            Completion.of(
                prep.prompts[choice.prompt_index],
                choice.token_ids,
                choice.logprobs,
                weight_version=choice.weight_version,
                finish_reason=(
                    FinishReason.LENGTH if choice.finish_reason == "length" else FinishReason.STOP
                ),
                temperature=prep.params.temperature,
            ),
        )

    def _choice(self, prep: Prepared, s: SampleOutput) -> Choice:
        ids, lps = list(s.token_ids), list(s.logprobs)
        text = self._decode(ids)
        stopped = False
        if prep.stop and _first_stop(text, prep.stop) is not None:
            ids, lps, text = self._cut_at_stop(ids, lps, prep.stop)
            stopped = True
        finish = "stop" if stopped or s.finish_reason == FinishReason.STOP else "length"
        content: str | None = text
        calls: list[dict[str, Any]] = []
        if prep.parse_tools:
            content, calls = parse_tool_calls(text)
            if calls:
                finish = "tool_calls"
        return Choice(
            index=s.prompt_index * prep.params.n + s.sample_index,
            prompt_index=s.prompt_index,
            token_ids=ids,
            logprobs=lps,
            text=text,
            finish_reason=finish,
            weight_version=s.weight_version,
            content=content,
            tool_calls=calls,
        )

    def _cut_at_stop(
        self, ids: list[int], lps: list[float], stop: Sequence[str]
    ) -> tuple[list[int], list[float], str]:
        """The shortest token prefix whose text holds a stop string (found by bisection:
        a few decodes), and its text up to that stop string (OpenAI leaves it out)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if _first_stop(self._decode(ids[:mid]), stop) is not None:
                hi = mid
            else:
                lo = mid + 1
        text = self._decode(ids[:lo])
        cut = _first_stop(text, stop)
        return ids[:lo], lps[:lo], text[: cut if cut is not None else len(text)]

    # ------------------------------------------------------------------ formatting

    def _logprobs_chat(self, c: Choice) -> dict[str, Any]:
        texts = self._token_texts(c.token_ids)
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, lp in zip(texts, c.logprobs, strict=True)
            ]
        }

    def _logprobs_completion(self, c: Choice) -> dict[str, Any]:
        texts = self._token_texts(c.token_ids)
        offsets, pos = [], 0
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": texts,
            "token_logprobs": c.logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def _message(self, c: Choice) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            msg["tool_calls"] = c.tool_calls
        return msg

    def _usage(self, prep: Prepared, choices: Sequence[Choice]) -> dict[str, int]:
        prompt = sum(len(p) for p in prep.prompts)
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _head(self, prep: Prepared, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl" if prep.kind == "chat" else "cmpl"
        return {
            "id": f"{prefix}-{prep.id}",
            "object": obj,
            "created": prep.created,
            "model": self.model_name,
        }

    def response(self, prep: Prepared, choices: Sequence[Choice]) -> dict[str, Any]:
        """The non-streaming body of a finished request (choices in index order)."""
        choices = sorted(choices, key=lambda c: c.index)
        version = max((c.weight_version for c in choices), default=0)
        if prep.kind == "chat":
            out = self._head(prep, "chat.completion")
            out["choices"] = [
                {
                    "index": c.index,
                    "message": self._message(c),
                    "logprobs": self._logprobs_chat(c) if prep.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
        else:
            out = self._head(prep, "text_completion")
            out["choices"] = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._logprobs_completion(c) if prep.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
        out["usage"] = self._usage(prep, choices)
        out["system_fingerprint"] = f"rlfleet-weights-v{version}"
        out["session_id"] = prep.session_id
        out["weight_version"] = version
        return out

    def chunks(self, prep: Prepared, c: Choice) -> list[dict[str, Any]]:
        """The stream chunks of one finished choice: its content, then its finish."""
        extra = {"session_id": prep.session_id, "weight_version": c.weight_version}
        if prep.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": c.content}
            if c.tool_calls:
                delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(c.tool_calls)]
            first = self._head(prep, "chat.completion.chunk") | extra
            first["choices"] = [
                {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": self._logprobs_chat(c) if prep.logprobs else None,
                    "finish_reason": None,
                }
            ]
            last = self._head(prep, "chat.completion.chunk") | extra
            last["choices"] = [
                {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason}
            ]
        else:
            first = self._head(prep, "text_completion") | extra
            first["choices"] = [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": self._logprobs_completion(c) if prep.logprobs else None,
                    "finish_reason": None,
                }
            ]
            last = self._head(prep, "text_completion") | extra
            last["choices"] = [
                {"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason}
            ]
        if prep.include_usage:
            first["usage"] = last["usage"] = None
        return [first, last]

    def usage_chunk(self, prep: Prepared, choices: Sequence[Choice]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if prep.kind == "chat" else "text_completion"
        out = self._head(prep, obj)
        out["choices"] = []
        out["usage"] = self._usage(prep, choices)
        return out

    # ------------------------------------------------------------------ sessions

    def finish_session(
        self, session_id: str, body: Mapping[str, Any], *, reward_required: bool
    ) -> dict[str, Any]:
        sid = _session_id(session_id, "session_id")
        reward = body.get("reward")
        if reward is None:
            if reward_required:
                raise ApiError(400, "reward (a finite number) is required", param="reward")
        elif not _is_number(reward) or abs(reward) > MAX_ABS_REWARD:
            raise ApiError(
                400,
                f"reward must be a finite number within +-{MAX_ABS_REWARD:g}, got {reward!r}",
                param="reward",
            )
        info: dict[str, str] = {}
        for key in ("group", "data_source", "ground_truth"):
            v = _opt_str(body, key, MAX_INFO_CHARS)
            if v is not None:
                info[key] = v
        try:
            t = self.store.finish(sid, None if reward is None else float(reward), info)
        except NotFound as e:
            raise ApiError(404, e.message, param="session_id", code="session_not_found") from None
        except FailedPrecondition as e:
            raise ApiError(409, e.message, param="session_id", code="session_finished") from None
        return {
            "session_id": sid,
            "finished": True,
            "reward": t.reward,
            "completions": len(t.completions),
            "generated_tokens": t.generated_tokens,
        }


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (empty), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if (
                not isinstance(p, dict)
                or p.get("type") != "text"
                or not isinstance(p.get("text"), str)
            ):
                raise ApiError(400, "only text content parts are supported",
                               param=f"{where}[{i}]")  # fmt: skip
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, "content must be a string or a list of text parts", param=where)


def _tool_calls_in(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls, arguments parsed into objects where they are
    JSON objects (templates render them with ``tojson``, as vLLM passes them)."""
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise ApiError(400, f"tool_calls must be a list of at most {MAX_TOOLS}", param=where)
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, 'a tool call is {"type": "function", "function": {"name", '
                           '"arguments"}}', param=f"{where}[{i}]")  # fmt: skip
        args: Any = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                parsed = json.loads(args, parse_constant=_reject_constant)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                args = parsed
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _stops(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise ApiError(
            400,
            f"stop must be a string or a list of at most {MAX_STOP} non-empty strings of up "
            f"to {MAX_STOP_CHARS} characters",
            param="stop",
        )
    return tuple(stops)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [i for s in stops if (i := text.find(s)) >= 0]
    return min(found) if found else None


_PARAM_OF = {
    "sampling.n": "n",
    "sampling.max_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.stop_token_ids": "stop",
}


def _unavailable(e: RlfleetError) -> ApiError:
    """The replica cannot serve now (shutting down, its engine asleep while a colocated
    trainer works): 503, which OpenAI clients retry with backoff."""
    return ApiError(503, str(e), code=e.code.lower())


def _api_error(e: RlfleetError, kind: str) -> ApiError:
    """A core or engine refusal as a 400 naming the OpenAI parameter."""
    prompt = "messages" if kind == "chat" else "prompt"
    param = _PARAM_OF.get(e.field) or (prompt if e.field.startswith("prompts") else None)
    code = "limit_exceeded" if e.code == "LIMIT_EXCEEDED" else e.code.lower()
    return ApiError(400, e.message, param=param, code=code)
