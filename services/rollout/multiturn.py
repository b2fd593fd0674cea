"""Multi-turn rollouts: each sample a conversation with tool calls. No sockets here
(tools are reached through :class:`~rlfleet.tools.client.ToolClient` objects).

A request's prompts become ``prompts x n`` conversations, driven in *rounds*::

    round k: every active conversation's context (prompt + its response so far)
             -> one engine batch (the core's batching thread takes the whole round:
                RolloutCore.submit_requests), each row with its own seed and the
                token budget it has left
             -> the model turn is appended (loss mask 1, its log-probs)
             -> tool calls parsed from the turn (Hermes / Qwen ``<tool_call>{"name":
                ..., "arguments": {...}}</tool_call>``)
             -> every call of every conversation of the round runs on one thread
                pool, each with its time-out
             -> the results are appended as a tool turn in the chat template's format
                (the assistant turn closed, the tool messages, the next assistant
                header; loss mask 0, log-probs 0)

A conversation ends when its model turn has no tool call (finish ``STOP``, or
``LENGTH`` when the turn hit its token cap), when it used ``max_turns`` model turns
or the response budget (the request's ``max_tokens``, tool turns included: verl's
``response_length``) and would need more (``LENGTH``). Finished conversations are
handed out as soon as their round ends, as one
:class:`~rlfleet.rollout.engine.SampleOutput` each: the whole response (model and
tool tokens), ``loss_mask`` marking the model's tokens, log-probs of the model's
tokens (0 elsewhere) and the oldest weight version any of its turns used.

**Exact tokens.** A turn is generated from the token ids of the context as they
are, never from re-tokenized text, and a tool turn is tokenized on its own and
appended, so the sequence the trainer gets is exactly the one the model was
conditioned on, and the rollout's log-probs equal a teacher-forced pass over it.

**Failures are turns.** A tool that fails (its error, a time-out, a crash, an
unknown tool, arguments that are not JSON, a service that is down) answers the
model with an ``Error: ...`` tool message; the rollout goes on.

**Seeds.** Turn ``t`` of sample ``(i, j)`` samples with a seed mixed from the
request's seed, ``i``, ``j`` and ``t``: a seeded request gives the same
conversations whatever else shares the replica.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rlfleet.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    RlfleetError,
    Unavailable,
)
from rlfleet.rollout.engine import (
    FinishReason,
    GenerationRequest,
    SampleOutput,
    SamplingParams,
    mix_seed,
)
from rlfleet.rollout.handle import DONE, SampleStream

if TYPE_CHECKING:
    from rlfleet.rollout.core import RolloutCore
    from rlfleet.tools.client import ToolClient
    from rlfleet.tools.core import ToolSpec

__all__ = [
    "ConversationHandle",
    "HermesToolParser",
    "MultiTurn",
    "MultiTurnSettings",
    "ParsedCall",
    "ToolBox",
    "ToolCallParser",
    "ToolTurnRenderer",
    "truncate",
]

logger = logging.getLogger(__name__)

#: Waiting for a tool past its time-out, before the runner gives up on it itself
#: (remote clients have their own deadline; this catches anything that hangs).
_GRACE_S = 5.0


@dataclass(frozen=True)
class MultiTurnSettings:
    """How conversations run (``rollout.multi_turn`` of the config).

    Attributes:
        max_turns: model turns per sample at most.
        max_tokens_per_turn: new tokens per model turn; None: the budget left.
        max_parallel_calls: tool calls run per model turn; later ones are answered
            with an error.
        max_tool_response_length: characters of a tool's answer the model sees.
        tool_response_truncate_side: which part of a longer answer is cut.
        tool_timeout_s: time-out of each tool call.
        tool_workers: tool calls run at once, across conversations.
    """

    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_timeout_s: float = 10.0
    tool_workers: int = 16

    def __post_init__(self) -> None:
        bad = [
            f"{k}={getattr(self, k)!r}"
            for k in ("max_turns", "max_parallel_calls", "max_tool_response_length", "tool_workers")
            if getattr(self, k) < 1
        ]
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            bad.append(f"max_tokens_per_turn={self.max_tokens_per_turn}")
        if not self.tool_timeout_s > 0:
            bad.append(f"tool_timeout_s={self.tool_timeout_s}")
        if bad:
            raise ValueError("multi-turn settings must be >= 1 (time-out > 0): " + ", ".join(bad))


# ------------------------------------------------------------------ tool-call parsing


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in a model turn: ``name`` and ``arguments`` (a JSON object
    as text), or ``error`` when it could not be read (the model is told why)."""

    name: str = ""
    arguments: str = "{}"
    error: str = ""


class ToolCallParser(Protocol):
    """Finds the tool calls in a model turn's text (the plug point for formats)."""

    def parse(self, text: str) -> list[ParsedCall]: ...


class HermesToolParser:
    """Hermes / Qwen calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number per turn, JSON between the tags (whitespace around it allowed).
    ``arguments`` may also be a JSON string holding the object. An opening tag left
    unclosed counts as a malformed call."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def parse(self, text: str) -> list[ParsedCall]:
        if self._OPEN not in text:
            return []
        calls = [self._one(m.group(1)) for m in self._CALL.finditer(text)]
        last_close = text.rfind("</tool_call>")
        if text.find(self._OPEN, last_close + 1 if last_close >= 0 else 0) >= 0:
            calls.append(ParsedCall(error="a <tool_call> tag was not closed with </tool_call>"))
        return calls

    @staticmethod
    def _one(body: str) -> ParsedCall:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError) as e:
            return ParsedCall(error=f"the tool call is not valid JSON: {e}")
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return ParsedCall(
                error='a tool call must be a JSON object {"name": ..., "arguments": {...}}'
            )
        args: Any = value.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:
                return ParsedCall(
                    value["name"], error=f"the arguments are not a valid JSON object: {e}"
                )
        if not isinstance(args, dict):
            return ParsedCall(value["name"], error="the arguments must be a JSON object")
        return ParsedCall(value["name"], json.dumps(args))


PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}


# ------------------------------------------------------------------ tool turns


def truncate(text: str, limit: int, side: Literal["left", "middle", "right"]) -> str:
    """``text`` cut to ``limit`` characters, ``side`` the part removed, marked."""
    if len(text) <= limit:
        return text
    mark = "...(truncated)..."
    keep = max(0, limit - len(mark))
    if side == "left":
        return mark + text[len(text) - keep :]
    if side == "right":
        return text[:keep] + mark
    head = keep // 2
    return text[:head] + mark + text[len(text) - (keep - head) :]


_MARK = "\u2063rlfleet-assistant\u2063"


def _placeholder(i: int) -> str:
    return f"\u2063rlfleet-tool-{i}\u2063"


_PLACEHOLDER = re.compile("\u2063rlfleet-tool-(\\d+)\u2063")


class ToolTurnRenderer:
    """Tool results as the token ids the chat template puts between the model's turn
    and its next one: the rest of the model's turn (its end-of-turn marker when the
    model did not generate it, the newline after), the tool messages in the
    template's format, and the next assistant header.

    Derived once from the template by rendering a probe conversation with and without
    tool messages (``role: tool``); templates that wrap tool results themselves (Qwen,
    Hermes: ``<tool_response>``) are used as they are, others (a plain ChatML
    template) get each result wrapped in ``<tool_response>`` tags, so the model reads
    the same markup either way.

    Raises:
        ValueError: the tokenizer has no chat template, or the template does not render
            tool messages as an extension of the conversation.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._base_msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": _MARK},
        ]
        base = self._render(self._base_msgs, generation_prompt=False)
        pos = base.rfind(_MARK)
        if pos < 0:
            raise ValueError("the chat template drops the assistant's content")
        self._base = base
        self.tail = base[pos + len(_MARK) :]
        first = self._template(1)
        self.wraps = "<tool_response>" not in first
        self._cache: dict[int, list[str]] = {}
        self._stop_text: dict[int, str] = {}

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        try:
            text = self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja errors, no template: say so at start-up
            raise ValueError(f"the tokenizer's chat template cannot render {messages}: {e}") from e
        return str(text)

    def _template(self, k: int) -> str:
        msgs = [*self._base_msgs, *({"role": "tool", "content": _placeholder(i)} for i in range(k))]
        full = self._render(msgs, generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError(
                "the chat template does not render tool messages after the conversation "
                f"unchanged (rendered {full[:200]!r}); multi-turn rollouts need one that does"
            )
        delta = full[len(self._base) :]
        found = [int(m) for m in _PLACEHOLDER.findall(delta)]
        if found != list(range(k)):
            raise ValueError(
                f"the chat template does not render each tool message's content once, in "
                f"order (found {found} for {k} messages)"
            )
        return delta

    def _pieces(self, k: int) -> list[str]:
        """The delta of ``k`` tool messages split around their contents: ``k + 1`` parts."""
        pieces = self._cache.get(k)
        if pieces is None:
            pieces = _PLACEHOLDER.split(self._template(k))[::2]
            self._cache[k] = pieces
        return pieces

    def text(self, results: Sequence[str], stop_id: int | None) -> str:
        """The tool turn for ``results`` after a model turn that ended with ``stop_id``
        (None: it ended without a stop token)."""
        if stop_id is None:
            closing = self.tail
        else:
            stop = self._stop_text.get(stop_id)
            if stop is None:
                stop = str(self._tok.decode([stop_id], skip_special_tokens=False))
                self._stop_text[stop_id] = stop
            closing = self.tail[len(stop) :] if stop and self.tail.startswith(stop) else self.tail
        pieces = self._pieces(len(results))
        if self.wraps:
            results = [f"<tool_response>\n{r}\n</tool_response>" for r in results]
        out = [closing, pieces[0]]
        for r, p in zip(results, pieces[1:], strict=True):
            out += [r, p]
        return "".join(out)

    def tokens(self, results: Sequence[str], stop_id: int | None) -> list[int]:
        ids = self._tok(self.text(results, stop_id), add_special_tokens=False)["input_ids"]
        return list(ids)


# ------------------------------------------------------------------ tools


class ToolBox:
    """Tool name -> the client that serves it, from several sources (each client
    lists its tools once, at start-up).

    Raises:
        ValueError: two sources offer a tool of the same name.
    """

    def __init__(self, clients: Sequence[tuple[ToolClient, str | None]]) -> None:
        self.clients = [c for c, _ in clients]
        self._by_name: dict[str, ToolClient] = {}
        self.specs: list[ToolSpec] = []
        for client, only in clients:
            specs = client.list_tools()
            if only is not None:
                specs = [s for s in specs if s.name == only]
                if not specs:
                    raise ValueError(f"a tool source lists no tool named {only!r}")
            for s in specs:
                if s.name in self._by_name:
                    raise ValueError(f"two tool sources offer a tool named {s.name!r}")
                self._by_name[s.name] = client
                self.specs.append(s)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def client(self, name: str) -> ToolClient | None:
        return self._by_name.get(name)

    def close(self) -> None:
        for c in self.clients:
            c.close()


@dataclass
class _CallOutcome:
    message: str
    tool: str
    outcome: str  # ok | error | timeout | unknown | invalid | unavailable
    seconds: float = 0.0


class _ToolMetrics:
    """``rlfleet_rollout_tool_calls{tool,outcome}``, ``rlfleet_rollout_tool_seconds``
    and ``rlfleet_rollout_turns`` in the replica's registry (no-ops without one)."""

    def __init__(self, registry: Any) -> None:
        self.calls: Any = None
        self.seconds: Any = None
        self.turns: Any = None
        if registry is None:
            return
        import prometheus_client as prom

        p = "rlfleet_rollout_"
        self.calls = prom.Counter(
            p + "tool_calls", "tool calls by tool and outcome", ["tool", "outcome"],
            registry=registry,
        )  # fmt: skip
        self.seconds = prom.Histogram(
            p + "tool_seconds", "wall time of a tool call", registry=registry,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
        )  # fmt: skip
        self.turns = prom.Histogram(
            p + "turns", "model turns per multi-turn sample", registry=registry,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
        )  # fmt: skip

    def call(self, o: _CallOutcome) -> None:
        if self.calls is not None:
            # Unknown names are the model's invention: one label, not one series each.
            self.calls.labels(o.tool if o.outcome != "unknown" else "", o.outcome).inc()
            self.seconds.observe(o.seconds)

    def conversation(self, turns: int) -> None:
        if self.turns is not None:
            self.turns.observe(turns)


class _ToolRunner:
    """Runs the calls of a round concurrently, each bounded, each answered."""

    def __init__(self, box: ToolBox, settings: MultiTurnSettings, metrics: _ToolMetrics) -> None:
        self.box = box
        self.settings = settings
        self.metrics = metrics
        self._pool = concurrent.futures.ThreadPoolExecutor(
            settings.tool_workers, thread_name_prefix="rlfleet-toolcall"
        )

    def run(self, turns: Sequence[Sequence[ParsedCall]]) -> list[list[str]]:
        """The messages answering each turn's calls, in order."""
        limit = self.settings.max_parallel_calls
        jobs: list[list[concurrent.futures.Future[_CallOutcome] | _CallOutcome]] = []
        for calls in turns:
            row: list[concurrent.futures.Future[_CallOutcome] | _CallOutcome] = []
            for k, call in enumerate(calls):
                if k >= limit:
                    row.append(
                        _CallOutcome(
                            f"Error: only {limit} tool call(s) per turn are run; this one was not",
                            call.name,
                            "invalid",
                        )
                    )
                else:
                    row.append(self._pool.submit(self._call, call))
            jobs.append(row)
        wait = self.settings.tool_timeout_s + _GRACE_S
        out: list[list[str]] = []
        for row in jobs:
            messages = []
            for job in row:
                outcome = job if isinstance(job, _CallOutcome) else self._result(job, wait)
                self.metrics.call(outcome)
                messages.append(outcome.message)
            out.append(messages)
        return out

    def _result(self, future: concurrent.futures.Future[_CallOutcome], wait: float) -> _CallOutcome:
        try:
            return future.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            future.cancel()
            t = self.settings.tool_timeout_s
            return _CallOutcome(f"Error: the tool did not answer within {t:g}s", "", "timeout", t)

    def _call(self, call: ParsedCall) -> _CallOutcome:
        if call.error:
            return _CallOutcome(f"Error: {call.error}", call.name, "invalid")
        client = self.box.client(call.name)
        if client is None:
            names = ", ".join(self.box.names) or "none"
            return _CallOutcome(
                f"Error: there is no tool named {call.name[:64]!r}; the tools are: {names}",
                call.name,
                "unknown",
            )
        s = self.settings
        t0 = time.perf_counter()
        try:
            result = client.call(call.name, call.arguments, timeout_s=s.tool_timeout_s)
        except DeadlineExceeded:
            seconds = time.perf_counter() - t0
            return _CallOutcome(
                f"Error: the tool did not answer within {s.tool_timeout_s:g}s",
                call.name, "timeout", seconds,
            )  # fmt: skip
        except (InvalidArgument, NotFound) as e:
            return _CallOutcome(f"Error: {e.message}", call.name, "invalid")
        except (Unavailable, RlfleetError, OSError) as e:
            # The model reads a short reason (it spends the response budget); the
            # address and the transport's detail go to the log.
            logger.warning("tool %s failed: %s", call.name, e)
            reason = (
                "its service is unreachable"
                if isinstance(e, Unavailable | OSError)
                else type(e).__name__
            )
            return _CallOutcome(
                f"Error: the tool failed: {reason}",
                call.name, "unavailable", time.perf_counter() - t0,
            )  # fmt: skip
        except Exception as e:  # a client bug must not end the rollout either
            logger.exception("tool %s: unexpected error", call.name)
            return _CallOutcome(
                f"Error: the tool failed: {type(e).__name__}: {e}", call.name, "error"
            )
        text = truncate(result.content, s.max_tool_response_length, s.tool_response_truncate_side)
        if result.timed_out:
            return _CallOutcome(
                f"Error: the tool timed out ({result.error})", call.name, "timeout", result.seconds
            )
        if result.error:
            msg = f"Error: {result.error}"
            msg = truncate(
                msg + (f"\n{result.content}" if result.content else ""),
                s.max_tool_response_length,
                s.tool_response_truncate_side,
            )
            return _CallOutcome(msg, call.name, "error", result.seconds)
        return _CallOutcome(text, call.name, "ok", result.seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------ conversations


@dataclass
class _Conversation:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    version: int | None = None
    finish: FinishReason | None = None
    # Per token, the weight version (inserted tokens: the last model turn's); kept in
    # the output only when a turn came tagged (a partial rollout).
    versions: list[int] = field(default_factory=list)
    tagged: bool = False

    def add_model(self, s: SampleOutput) -> None:
        n = len(s.token_ids)
        self.tokens += s.token_ids
        self.logprobs += s.logprobs
        self.mask += [1] * n
        self.turns += 1
        self.version = (
            s.weight_version if self.version is None else min(self.version, s.weight_version)
        )
        self.tagged |= bool(s.token_weight_versions)
        self.versions += s.token_weight_versions or [s.weight_version] * n

    def add_inserted(self, ids: list[int], logprobs: bool) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else self.version or 0] * len(ids)
        if logprobs:
            self.logprobs += [0.0] * len(ids)

    def output(self) -> SampleOutput:
        assert self.finish is not None
        return SampleOutput(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.finish,
            weight_version=self.version or 0,
            loss_mask=self.mask,
            token_weight_versions=self.versions if self.tagged else [],
        )


class ConversationHandle(SampleStream):
    """A submitted multi-turn request: iterate it for its samples as they finish;
    :meth:`cancel` stops it at the next round (the running round's generation is
    cancelled too). Same use as :class:`~rlfleet.rollout.core.GenerationHandle`."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        self.samples = samples
        self._lock = threading.Lock()
        self._round: list[Any] = []

    def cancel(self) -> None:
        super().cancel()
        with self._lock:
            running = list(self._round)
        for h in running:
            h.cancel()

    def _set_round(self, handles: list[Any]) -> None:
        with self._lock:
            self._round = handles
        if self.cancelled:
            for h in handles:
                h.cancel()


class MultiTurn:
    """Runs requests as conversations on a :class:`~rlfleet.rollout.core.RolloutCore`
    (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer (decodes model turns, renders tool turns).
        tools: where the tools are.
        settings: limits of a conversation.
        parser: finds tool calls (default: Hermes).
        metrics_registry: a ``prometheus_client`` registry for the tool metrics.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: ToolBox,
        settings: MultiTurnSettings | None = None,
        *,
        parser: ToolCallParser | None = None,
        metrics_registry: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.settings = settings or MultiTurnSettings()
        self.parser: ToolCallParser = parser or HermesToolParser()
        self.renderer = ToolTurnRenderer(tokenizer)
        self._metrics = _ToolMetrics(metrics_registry)
        self._runner = _ToolRunner(tools, self.settings, self._metrics)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return list(self.tools.specs)

    def submit(
        self,
        core: RolloutCore,
        request: GenerationRequest,
        *,
        min_weight_version: int = 0,
    ) -> ConversationHandle:
        """Start ``request`` (already validated by the core) as conversations on a
        thread of its own; returns at once."""
        handle = ConversationHandle(len(request.prompts) * request.params.n)
        thread = threading.Thread(
            target=self._drive,
            args=(core, request, min_weight_version, handle),
            name="rlfleet-multiturn",
            daemon=True,
        )
        thread.start()
        return handle

    def _drive(
        self,
        core: RolloutCore,
        request: GenerationRequest,
        min_weight_version: int,
        handle: ConversationHandle,
    ) -> None:
        try:
            self._conversations(core, request, min_weight_version, handle)
        except BaseException as e:
            handle._put(e)
        finally:
            handle._put(DONE)

    def _conversations(
        self,
        core: RolloutCore,
        request: GenerationRequest,
        min_weight_version: int,
        handle: ConversationHandle,
    ) -> None:
        params = request.params
        s = self.settings
        budget = params.max_tokens
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        active = [
            _Conversation(i, j, list(p))
            for i, p in enumerate(request.prompts)
            for j in range(params.n)
        ]
        while active and not handle.cancelled:
            requests = []
            for c in active:
                left = budget - len(c.tokens)
                per_turn = (
                    left if s.max_tokens_per_turn is None else min(left, s.max_tokens_per_turn)
                )
                p: SamplingParams = replace(
                    params,
                    n=1,
                    max_tokens=per_turn,
                    seed=mix_seed(
                        base_seed, request.seed_index(c.prompt_index), c.sample_index, c.turns
                    ),
                )
                requests.append(GenerationRequest([c.prompt + c.tokens], p))
            handles = core.submit_requests(requests, min_weight_version=min_weight_version)
            handle._set_round(handles)
            outs: list[SampleOutput] = []
            try:
                for h in handles:
                    got = list(h)
                    if not got:  # cancelled
                        return
                    outs.append(got[0])
            except BaseException:
                for h in handles:
                    h.cancel()
                raise
            active = self._after_round(active, outs, budget, params.logprobs, handle)

    def _after_round(
        self,
        active: list[_Conversation],
        outs: list[SampleOutput],
        budget: int,
        logprobs: bool,
        handle: ConversationHandle,
    ) -> list[_Conversation]:
        s = self.settings
        calling: list[tuple[_Conversation, list[ParsedCall], int | None]] = []
        finished: list[_Conversation] = []
        for c, out in zip(active, outs, strict=True):
            c.add_model(out)
            calls: list[ParsedCall] = []
            if len(c.tokens) < budget:
                text = self.tokenizer.decode(out.token_ids, skip_special_tokens=False)
                calls = self.parser.parse(text)
            if not calls:
                c.finish = out.finish_reason if len(c.tokens) < budget else FinishReason.LENGTH
            elif c.turns >= s.max_turns:
                c.finish = FinishReason.LENGTH  # wanted a tool, no turn left
            else:
                stop = out.token_ids[-1] if out.finish_reason == FinishReason.STOP else None
                calling.append((c, calls, stop))
                continue
            finished.append(c)
        results = self._runner.run([calls for _, calls, _ in calling]) if calling else []
        going = []
        for (c, _, stop), messages in zip(calling, results, strict=True):
            ids = self.renderer.tokens(messages, stop)
            if len(c.tokens) + len(ids) >= budget:  # no room left for the model's answer
                c.finish = FinishReason.LENGTH
                finished.append(c)
                continue
            c.add_inserted(ids, logprobs)
            going.append(c)
        for c in finished:
            self._metrics.conversation(c.turns)
            handle._put(c.output())
        return going

    def close(self) -> None:
        self._runner.close()
        self.tools.close()


def settings_from_config(config: Any) -> MultiTurnSettings:
    """:class:`MultiTurnSettings` of ``rollout.multi_turn``."""
    m = config.rollout.multi_turn
    return MultiTurnSettings(
        max_turns=m.max_turns,
        max_tokens_per_turn=m.max_tokens_per_turn,
        max_parallel_calls=m.max_parallel_calls,
        max_tool_response_length=m.max_tool_response_length,
        tool_response_truncate_side=m.tool_response_truncate_side,
        tool_timeout_s=m.tool_timeout_s,
        tool_workers=m.tool_workers,
    )


def tool_box_from_config(config: Any, *, service: ToolClient | None = None) -> ToolBox:
    """The tool sources of ``rollout.multi_turn.tools`` as clients.

    Args:
        config: the run config.
        service: the client of the run's tools service (sources of kind ``service``);
            None: ``services.tools`` over gRPC.

    Raises:
        ValueError: a ``service`` source and neither ``service`` nor ``services.tools``.
    """
    from rlfleet.tools.builtin import tool_core_from_config
    from rlfleet.tools.client import HttpToolClient, InProcessToolClient, RemoteToolClient
    from rlfleet.tools.core import ToolSpec

    sources: list[tuple[ToolClient, str | None]] = []
    builtins = [t.name for t in config.rollout.multi_turn.tools if t.kind == "builtin"]
    try:
        if builtins:
            core = tool_core_from_config(config.tools, [n for n in builtins if n])
            sources.append((InProcessToolClient(core, own=True), None))
        for i, t in enumerate(config.rollout.multi_turn.tools):
            if t.kind == "service":
                client = service
                if client is None:
                    if config.services.tools is None:
                        raise ValueError(
                            f"rollout.multi_turn.tools[{i}] is the run's tools service, but "
                            "services.tools gives no address (a launcher starts one and sets "
                            "it; `rlfleet serve tools` starts one by hand)"
                        )
                    client = RemoteToolClient(config.services.tools)
                sources.append((client, t.name))
            elif t.kind == "grpc":
                sources.append((RemoteToolClient(str(t.address)), t.name))
            elif t.kind == "http":
                spec = ToolSpec(str(t.name), t.description, dict(t.parameters))
                sources.append((HttpToolClient(str(t.address), spec), None))
        return ToolBox(sources)
    except BaseException:
        for c, _ in sources:
            c.close()
        raise


def multi_turn_from_config(
    config: Any,
    tokenizer: Any,
    *,
    service: ToolClient | None = None,
    metrics_registry: Any = None,
) -> MultiTurn | None:
    """The :class:`MultiTurn` of ``rollout.multi_turn`` (None when it is off)."""
    if not config.rollout.multi_turn.enable:
        return None
    box = tool_box_from_config(config, service=service)
    try:
        mt = MultiTurn(
            tokenizer, box, settings_from_config(config), metrics_registry=metrics_registry
        )
    except BaseException:
        box.close()
        raise
    logger.info("multi-turn rollouts: up to %d turns, tools %s", mt.settings.max_turns, box.names)
    return mt


def describe(specs: Sequence[ToolSpec]) -> list[Mapping[str, Any]]:
    """The tools in the form chat templates take (``apply_chat_template(tools=...)``)."""
    return [s.to_openai() for s in specs]
