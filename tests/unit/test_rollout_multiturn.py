"""Pieces of multi-turn rollouts: the Hermes tool-call parser, the tool turn from the
chat template (a plain ChatML template and a Qwen-style one that wraps results
itself), truncation, and the tool runner's answers to every kind of failure."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.errors import DeadlineExceeded, Unavailable
from rlfleet.rollout.multiturn import (
    HermesToolParser,
    MultiTurnSettings,
    ParsedCall,
    ToolBox,
    ToolTurnRenderer,
    _ToolMetrics,
    _ToolRunner,
    truncate,
)
from rlfleet.tools.builtin import Calculator
from rlfleet.tools.client import InProcessToolClient
from rlfleet.tools.core import ToolCore, ToolLimits, ToolResult, ToolSpec

# ------------------------------------------------------------------ parsing


def test_parser_finds_every_call_in_order() -> None:
    text = (
        'thinking <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
        '</tool_call> and <tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n'
        "</tool_call>"
    )
    calls = HermesToolParser().parse(text)
    assert [c.name for c in calls] == ["calculator", "python"]
    assert json.loads(calls[0].arguments) == {"expression": "1+1"}
    assert not any(c.error for c in calls)


def test_parser_reads_arguments_given_as_a_json_string() -> None:
    [call] = HermesToolParser().parse(
        '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 2}"}</tool_call>'
    )
    assert call.name == "calc" and json.loads(call.arguments) == {"x": 2}


def test_text_without_calls_has_none() -> None:
    assert HermesToolParser().parse("#### 42") == []


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', "JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "JSON object"),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "c", "arguments": "{oops"}</tool_call>', "not a valid JSON"),
        ('<tool_call>{"name": "c", "arguments": {}}', "not closed"),
    ],
)
def test_malformed_calls_carry_the_reason(text: str, why: str) -> None:
    calls = HermesToolParser().parse(text)
    assert calls and why in calls[-1].error


# ------------------------------------------------------------------ truncation


def test_truncate_each_side() -> None:
    text = "abcdefghijklmnopqrstuvwxyz" * 4
    for side in ("left", "middle", "right"):
        out = truncate(text, 40, side)  # type: ignore[arg-type]
        assert len(out) == 40 and "(truncated)" in out
    assert truncate(text, 40, "right").startswith("abc")
    assert truncate(text, 40, "left").endswith("xyz")
    m = truncate(text, 40, "middle")
    assert m.startswith("abc") and m.endswith("xyz")
    assert truncate("short", 40, "middle") == "short"


# ------------------------------------------------------------------ the tool turn

# A Qwen2.5-style template, written for this test: tool messages become user turns
# holding <tool_response> blocks, consecutive ones grouped into one turn.
QWEN_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def test_plain_chatml_template_gets_wrapped_results(tok: Any) -> None:
    r = ToolTurnRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert r.wraps and r.tail == "<|im_end|>\n"
    text = r.text(["42"], im_end)
    assert text == (
        "\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The model's turn did not end with its end token: the turn is closed for it.
    assert r.text(["42"], None).startswith("<|im_end|>\n<|im_start|>tool\n")


def test_the_tool_turn_is_what_the_template_renders(tok: Any) -> None:
    """Model turn + tool turn tokens == the template's rendering of the conversation."""
    r = ToolTurnRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
        {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"},
    ]
    whole = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    pieced = prompt + "<tool_call>x</tool_call><|im_end|>" + r.text(["42"], im_end)
    assert pieced == whole


def test_a_template_that_wraps_results_is_used_as_is(tok: Any) -> None:
    tok = tok.__class__.from_pretrained(tok.name_or_path, local_files_only=True)
    tok.chat_template = QWEN_STYLE
    r = ToolTurnRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert not r.wraps
    assert r.text(["1", "2"], im_end) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = r.tokens(["7"], im_end)
    assert tok.decode(ids, skip_special_tokens=False) == r.text(["7"], im_end)


def test_a_template_that_drops_tool_messages_is_refused(tok: Any) -> None:
    tok = tok.__class__.from_pretrained(tok.name_or_path, local_files_only=True)
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role != 'tool' %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
    )
    with pytest.raises(ValueError, match="tool message"):
        ToolTurnRenderer(tok)


# ------------------------------------------------------------------ the runner


class Slow:
    spec = ToolSpec("slow", "sleeps", {"type": "object"})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        time.sleep(3.0)
        return "late"


class Crash:
    spec = ToolSpec("crash", "raises", {"type": "object"})

    def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
        raise ValueError("segfault, more or less")


class Down:
    """A tool source whose service went away: every call raises."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def list_tools(self) -> list[ToolSpec]:
        return [ToolSpec("remote", "far away", {"type": "object"})]

    def call(self, name: str, arguments_json: str, *, timeout_s: float, call_id: str = "") -> Any:
        raise self.error

    def close(self) -> None:
        pass


def _runner(*extra: Any, **settings: Any) -> _ToolRunner:
    core = ToolCore([Calculator(), Slow(), Crash()], ToolLimits(default_timeout_s=5.0))
    box = ToolBox([(InProcessToolClient(core, own=True), None), *((e, None) for e in extra)])
    s = MultiTurnSettings(**{"tool_timeout_s": 0.5, **settings})
    return _ToolRunner(box, s, _ToolMetrics(None))


def _call(name: str, **args: Any) -> ParsedCall:
    return ParsedCall(name, json.dumps(args))


def test_runner_answers_each_call() -> None:
    [[ok]] = _runner().run([[_call("calculator", expression="6*7")]])
    assert ok == "42"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (_call("slow"), "timed out"),
        (_call("crash"), "ValueError: segfault, more or less"),
        (_call("nope"), "no tool named 'nope'; the tools are: calculator, slow, crash"),
        (ParsedCall("calculator", "{bad"), "not valid JSON"),
        (ParsedCall(error="the tool call is not valid JSON: x"), "not valid JSON"),
        (_call("calculator", expression="1/0"), "division by zero"),
        (_call("calculator"), "missing required argument"),
    ],
)
def test_a_failing_tool_is_an_error_message_never_an_exception(
    call: ParsedCall, expected: str
) -> None:
    [[message]] = _runner().run([[call]])
    assert message.startswith("Error:") and expected in message


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (Unavailable("tool service 127.0.0.1:1: connection refused"), "service is unreachable"),
        (DeadlineExceeded("no answer"), "did not answer within 0.5s"),
        (RuntimeError("client bug"), "RuntimeError: client bug"),
    ],
)
def test_an_unreachable_tool_service_is_an_error_message(error: Exception, expected: str) -> None:
    [[message]] = _runner(Down(error)).run([[_call("remote")]])
    assert message.startswith("Error:") and expected in message


def test_calls_over_the_per_turn_limit_are_answered_not_run() -> None:
    [answers] = _runner(max_parallel_calls=1).run(
        [[_call("calculator", expression="1+1"), _call("calculator", expression="2+2")]]
    )
    assert answers[0] == "2" and "only 1 tool call(s) per turn" in answers[1]


def test_calls_of_many_conversations_run_concurrently() -> None:
    """Eight calls meet at a barrier of eight: they pass only if they run side by side."""
    import threading

    barrier = threading.Barrier(8, timeout=10.0)

    class Gate:
        spec = ToolSpec("gate", "waits for the others", {"type": "object"})

        def call(self, arguments: Mapping[str, Any], timeout_s: float) -> str:
            barrier.wait()
            return "met"

    core = ToolCore([Gate()], ToolLimits(default_timeout_s=20.0, max_concurrent_calls=8))
    box = ToolBox([(InProcessToolClient(core, own=True), None)])
    runner = _ToolRunner(
        box, MultiTurnSettings(tool_timeout_s=20.0, tool_workers=8), _ToolMetrics(None)
    )
    assert runner.run([[_call("gate")] for _ in range(8)]) == [["met"]] * 8


def test_long_answers_are_truncated() -> None:
    runner = _runner(max_tool_response_length=20)
    [[m]] = runner.run([[_call("calculator", expression="7 ** 80")]])
    assert len(m) == 20 and "(truncated)" in m


def test_duplicate_tool_names_across_sources_are_refused() -> None:
    a = InProcessToolClient(ToolCore([Calculator()]))
    b = InProcessToolClient(ToolCore([Calculator()]))
    with pytest.raises(ValueError, match="two tool sources"):
        ToolBox([(a, None), (b, None)])


def test_a_source_can_offer_one_of_its_tools() -> None:
    core = ToolCore([Calculator(), Crash()])
    box = ToolBox([(InProcessToolClient(core), "calculator")])
    assert box.names == ["calculator"]
    with pytest.raises(ValueError, match="no tool named"):
        ToolBox([(InProcessToolClient(core), "missing")])


def test_tool_result_with_partial_content() -> None:
    class Partial:
        def list_tools(self) -> list[ToolSpec]:
            return [ToolSpec("p", "", {"type": "object"})]

        def call(self, name: str, arguments_json: str, **kw: Any) -> ToolResult:
            return ToolResult("half done", error="exit code 1")

        def close(self) -> None:
            pass

    [[m]] = _runner(Partial()).run([[_call("p")]])
    assert m == "Error: exit code 1\nhalf done"


def test_conversation_keeps_the_versions_of_its_model_tokens() -> None:
    """A partial rollout's turn (tagged per token) and a whole turn make one sample's
    per-token versions; inserted tokens take the preceding turn's last version."""
    from rlfleet.rollout.engine import FinishReason, SampleOutput
    from rlfleet.rollout.multiturn import _Conversation

    c = _Conversation(prompt_index=0, sample_index=0, prompt=[1])
    c.add_model(SampleOutput(0, 0, [5, 6, 7], [-1.0] * 3, FinishReason.STOP, 2,
                             token_weight_versions=[2, 3, 3]))  # fmt: skip
    c.add_inserted([8, 9], logprobs=True)
    c.add_model(SampleOutput(0, 0, [10, 11], [-1.0] * 2, FinishReason.STOP, 3))
    c.finish = FinishReason.STOP
    out = c.output()
    assert out.weight_version == 2  # the oldest
    assert out.token_weight_versions == [2, 3, 3, 3, 3, 3, 3]
    assert out.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    # No turn tagged (partial rollouts off): no per-token list, as before.
    plain = _Conversation(prompt_index=0, sample_index=0, prompt=[1])
    plain.add_model(SampleOutput(0, 0, [5], [-1.0], FinishReason.STOP, 1))
    plain.finish = FinishReason.STOP
    assert plain.output().token_weight_versions == []
